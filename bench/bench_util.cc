#include "bench_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

extern char** environ;

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

// ---------------------------------------------------------------------------------------
// LineProcess
// ---------------------------------------------------------------------------------------

absl::Status LineProcess::Start(const std::vector<std::string>& argv) {
  if (pid_ > 0) return absl::FailedPreconditionError("LineProcess: already started");
  if (argv.empty()) return absl::InvalidArgumentError("argv: empty");
  // Close-on-exec: the child keeps only its own ends, dup'ed to its stdin and stdout.
  int to[2] = {-1, -1}, from[2] = {-1, -1};
  if (::pipe2(to, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  if (::pipe2(from, O_CLOEXEC) != 0) {
    const int err = errno;
    ::close(to[0]);
    ::close(to[1]);
    return ErrnoError("pipe2", err);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, from[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(to[0]);
  ::close(from[1]);
  in_ = to[1];
  out_ = from[0];
  if (err != 0) {
    Stop();
    return ErrnoError(StrCat("posix_spawn ", argv[0]), err);
  }
  pid_ = pid;
  return absl::OkStatus();
}

absl::Status LineProcess::Send(const std::string& line) {
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    // MSG_NOSIGNAL is for sockets: a pipe whose reader is gone raises SIGPIPE unless ignored,
    // so block it around the write and take EPIPE as the answer.
    // A write that the reader's close cuts short raises SIGPIPE even when it wrote part of
    // the data, so whatever this write left pending is taken, not only after EPIPE.
    sigset_t pipe_only, old, pending;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
    sigpending(&pending);
    const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    const ssize_t n = in_ >= 0 ? ::write(in_, data.data() + done, data.size() - done) : -1;
    const int err = in_ >= 0 ? errno : EPIPE;
    sigpending(&pending);
    if (!was_pending && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      (void)sigtimedwait(&pipe_only, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    if (n < 0 && err == EINTR) continue;
    if (n <= 0) return absl::InternalError(StrCat("process ", pid_, " is gone (", std::strerror(err), ")"));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LineProcess::ReadLine(absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  size_t eol;
  while ((eol = buffered_.find('\n')) == std::string::npos) {
    if (out_ < 0) return absl::InternalError(StrCat("process ", pid_, " ended"));
    const absl::Duration left = give_up - absl::Now();
    if (left <= absl::ZeroDuration())
      return absl::DeadlineExceededError(
          StrCat("process ", pid_, " did not answer within ", absl::FormatDuration(timeout)));
    pollfd pfd{out_, POLLIN, 0};
    const int64_t ms = std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000);
    const int n = ::poll(&pfd, 1, static_cast<int>(ms));
    if (n < 0 && errno != EINTR) return ErrnoError("poll", errno);
    if (n <= 0) continue;
    char buf[4096];
    const ssize_t got = ::read(out_, buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return absl::InternalError(StrCat("process ", pid_, " ended"));
    buffered_.append(buf, static_cast<size_t>(got));
  }
  std::string line = buffered_.substr(0, eol);
  buffered_.erase(0, eol + 1);
  return line;
}

int LineProcess::Stop(const std::string& quit_line, absl::Duration grace) {
  if (!quit_line.empty() && in_ >= 0 && pid_ > 0) (void)Send(quit_line);
  if (in_ >= 0) ::close(in_);
  in_ = -1;
  int status = -1;
  if (pid_ > 0) {
    const absl::Time give_up = absl::Now() + grace;
    for (;;) {
      int st = 0;
      const pid_t got = ::waitpid(pid_, &st, WNOHANG);
      if (got == pid_) {
        status = st;
        break;
      }
      if (got < 0 && errno != EINTR) break;
      if (absl::Now() >= give_up) {
        ::kill(pid_, SIGKILL);
        while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
        }
        status = st;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  pid_ = -1;
  if (out_ >= 0) ::close(out_);
  out_ = -1;
  buffered_.clear();
  return status;
}

}  // namespace ulysses::bench
