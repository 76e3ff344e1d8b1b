// A child process the daemon owns for a while: it answers one line on its standard output and
// lives until its standard input closes. The nccl backend runs NCCL's bootstrap root in one
// (NcclRootHelper), so that a session that fails part way cannot leave the root's thread and
// listening socket in the daemon for its life: ending the helper ends them.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::daemon {

class HelperProcess {
 public:
  HelperProcess() = default;
  HelperProcess(HelperProcess&& other) noexcept;
  HelperProcess& operator=(HelperProcess&& other) noexcept;
  HelperProcess(const HelperProcess&) = delete;
  HelperProcess& operator=(const HelperProcess&) = delete;
  ~HelperProcess() { (void)Stop(); }

  /// Starts `argv` (argv[0] is the program's path), its standard input and output pipes to
  /// this process, its standard error this process's, and reads its first line; the program
  /// must write nothing more on its standard output (its end is closed after the line). A program
  /// that cannot start, that exits or closes its output before a whole line, or that does not
  /// write one within `answer_within` (then it is killed), is an error naming argv[0] and,
  /// where it exited, its status and what it wrote; it is reaped before the error returns.
  static absl::StatusOr<HelperProcess> Start(const std::vector<std::string>& argv,
                                             absl::Duration answer_within);

  /// The first line it wrote, without its newline.
  const std::string& answer() const { return answer_; }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  /// Closes its standard input, which tells it to exit; kills it if it has not within
  /// `grace`; reaps it. Returns its wait status (waitpid's), or -1 where there was no child
  /// to reap (already stopped) or waitpid failed. Idempotent.
  int Stop(absl::Duration grace = absl::Seconds(1));

 private:
  pid_t pid_ = -1;
  ipc::UniqueFd stdin_;  // the write end of its standard input
  std::string answer_;
};

/// The daemon's own program, to start a helper mode of it: /proc/self/exe.
std::string SelfExecutable();

}  // namespace ulysses::daemon
