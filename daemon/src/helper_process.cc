#include "helper_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "ulysses/common/strings.h"

extern char** environ;

namespace ulysses::daemon {
namespace {

// How a reaped child ended (its wait status, -1 where it could not be reaped), for a message.
std::string Ended(int status) {
  if (status == -1) return "ended (its status could not be read)";
  if (WIFEXITED(status)) return StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return StrCat("was killed by signal ", WTERMSIG(status));
  return "ended";
}

// Waits for `pid` to end, up to `grace` (then kills it), and reaps it; returns its wait status,
// or -1 where waitpid failed.
int Reap(pid_t pid, absl::Duration grace) {
  int status = 0;
  const absl::Time give_up = absl::Now() + grace;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) return -1;
    if (absl::Now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  kill(pid, SIGKILL);
  for (;;) {
    if (waitpid(pid, &status, 0) == pid) return status;
    if (errno != EINTR) return -1;
  }
}

}  // namespace

HelperProcess::HelperProcess(HelperProcess&& other) noexcept
    : pid_(other.pid_), stdin_(std::move(other.stdin_)), answer_(std::move(other.answer_)) {
  other.pid_ = -1;
}

HelperProcess& HelperProcess::operator=(HelperProcess&& other) noexcept {
  if (this != &other) {
    Stop();
    pid_ = other.pid_;
    other.pid_ = -1;
    stdin_ = std::move(other.stdin_);
    answer_ = std::move(other.answer_);
  }
  return *this;
}

absl::StatusOr<HelperProcess> HelperProcess::Start(const std::vector<std::string>& argv,
                                                   absl::Duration answer_within) {
  if (argv.empty()) return absl::InvalidArgumentError("argv: no program to start");
  const std::string& program = argv[0];
  // Both pipes close on exec in this process's other children; the child gets its ends as its
  // standard input and output.
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0)
    return absl::InternalError(StrCat("pipe2 for ", program, ": ", std::strerror(errno)));
  ipc::UniqueFd in_read(in[0]), in_write(in[1]);
  if (pipe2(out, O_CLOEXEC) != 0)
    return absl::InternalError(StrCat("pipe2 for ", program, ": ", std::strerror(errno)));
  ipc::UniqueFd out_read(out[0]), out_write(out[1]);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_read.get(), 0);
  posix_spawn_file_actions_adddup2(&actions, out_write.get(), 1);
  // The daemon blocks its stop signals (a thread of its own takes them) and ignores SIGPIPE;
  // the helper starts with no signal blocked and those at their defaults.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGTERM, SIGINT, SIGHUP}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  HelperProcess helper;
  const int spawned = posix_spawn(&helper.pid_, program.c_str(), &actions, &attr, args.data(),
                                  environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    helper.pid_ = -1;
    return absl::FailedPreconditionError(
        StrCat("cannot start ", program, ": ", std::strerror(spawned)));
  }
  in_read.reset();
  out_write.reset();
  helper.stdin_ = std::move(in_write);

  // Its first line, within the deadline.
  std::string got;
  const absl::Time deadline = absl::Now() + answer_within;
  for (;;) {
    const size_t newline = got.find('\n');
    if (newline != std::string::npos) {
      helper.answer_ = got.substr(0, newline);
      return helper;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      kill(helper.pid_, SIGKILL);
      helper.Stop();
      return absl::DeadlineExceededError(
          StrCat(program, " wrote no line within ", absl::FormatDuration(answer_within)));
    }
    pollfd p{out_read.get(), POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno != EINTR) {
      const std::string why = std::strerror(errno);
      helper.Stop(absl::ZeroDuration());
      return absl::InternalError(StrCat("poll on ", program, "'s output: ", why));
    }
    if (ready <= 0) continue;  // interrupted, or the deadline check above ends it
    char buf[512];
    const ssize_t n = read(out_read.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // It closed its output without a whole line: it has exited, or will (its input closed
      // too, as a helper told to end).
      helper.stdin_.reset();
      const int status = Reap(helper.pid_, absl::Seconds(1));
      helper.pid_ = -1;
      return absl::FailedPreconditionError(
          StrCat(program, " ", Ended(status), " before answering",
                 got.empty() ? std::string() : StrCat(" (it wrote \"", got, "\")")));
    }
    got.append(buf, static_cast<size_t>(n));
  }
}

int HelperProcess::Stop(absl::Duration grace) {
  stdin_.reset();
  if (pid_ <= 0) return -1;
  const int status = Reap(pid_, grace);
  pid_ = -1;
  return status;
}

std::string SelfExecutable() { return "/proc/self/exe"; }

}  // namespace ulysses::daemon
