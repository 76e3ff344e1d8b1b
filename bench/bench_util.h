// Pieces the benches share: sample statistics, W threads run in lockstep, a cluster of W
// ulyssesd processes with one or more sets of clients (one client per rank per set), and child
// processes driven by lines.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "demo_lib.h"
#include "ulysses/client/client.h"

namespace ulysses::bench {

// ---------------------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------------------

/// Linear-interpolated quantile q in [0, 1]; 0 for no samples.
double Quantile(std::vector<double> v, double q);
double Median(const std::vector<double>& v);
/// Numbers in the JSON: microseconds to the nanosecond, ratios to 4 decimals.
double RoundTo(double v, double scale);
inline double Us(double v) { return RoundTo(v, 1e3); }
inline double Ratio(double v) { return RoundTo(v, 1e4); }
void Append(std::vector<double>* to, const std::vector<double>& from);

/// "[tool] line" on stderr.
void Log(std::string_view tool, const std::string& line);

/// Whether an MPS control daemon's pipe is present: $CUDA_MPS_PIPE_DIRECTORY, else
/// /tmp/nvidia-mps, holds a "control" entry.
bool MpsPipePresent();

/// Writes `text` and a newline to `path` (replacing it); INTERNAL naming the path if it fails.
absl::Status WriteTextFile(const std::string& path, const std::string& text);

/// The current UTC time, ISO 8601 to the second ("2025-01-31T12:00:00Z").
std::string UtcNowIso();

// ---------------------------------------------------------------------------------------
// Running W threads in lockstep
// ---------------------------------------------------------------------------------------

/// What one block of iterations measured.
struct BlockTimes {
  std::vector<double> iter_us;      ///< barrier to barrier, seen from thread 0
  std::vector<double> work_max_us;  ///< per iteration, the slowest rank's own work time
};

/// Runs one untimed, then `iterations` timed iterations of `work(rank)` on `world` threads.
/// Every iteration ends at a barrier that all threads reach; thread 0 reads the clock after
/// each barrier. When `before_each` is given, thread 0 runs it before every iteration (the
/// lead-in included) and all threads meet at a barrier after it: it is outside every time.
/// A failing rank keeps meeting the barriers (so no thread waits forever) and the first error
/// is returned.
absl::StatusOr<BlockTimes> RunBlock(int world, int iterations,
                                    const std::function<absl::Status(int)>& work,
                                    const std::function<absl::Status()>& before_each = nullptr);

/// Runs `fn(rank)` once on `world` threads at the same time (for collective setup calls);
/// returns the first error.
absl::Status RunCollective(int world, const std::function<absl::Status(int)>& fn);

// ---------------------------------------------------------------------------------------
// A child process driven by lines
// ---------------------------------------------------------------------------------------

/// A program run with its stdin and stdout as pipes of this process: commands are lines
/// written to it, answers lines read from it. Stop (or destruction) ends it on every path.
class LineProcess {
 public:
  LineProcess() = default;
  ~LineProcess() { Stop(); }
  LineProcess(const LineProcess&) = delete;
  LineProcess& operator=(const LineProcess&) = delete;

  /// Runs `argv[0]` (a path) with `argv` and this process's environment. The child keeps only
  /// its two pipes of these and the descriptors of this process that are not close-on-exec.
  absl::Status Start(const std::vector<std::string>& argv);
  /// Writes `line` and a newline; INTERNAL when the child is gone.
  absl::Status Send(const std::string& line);
  /// The next line (without its newline), waiting at most `timeout`: DEADLINE_EXCEEDED after
  /// that, INTERNAL when the child closed its stdout (it ended).
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  /// Writes `quit_line` unless empty, closes the child's stdin, waits at most `grace` for it
  /// to exit, then kills it (SIGKILL) and reaps it; closes both pipes. Idempotent. Its exit
  /// status as waitpid gives it, or -1 when there was no child.
  int Stop(const std::string& quit_line = "", absl::Duration grace = absl::Seconds(10));
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int in_ = -1;   // the child's stdin, written here
  int out_ = -1;  // the child's stdout, read here
  std::string buffered_;
};

// ---------------------------------------------------------------------------------------
// W daemons and their clients
// ---------------------------------------------------------------------------------------

/// W daemons of one backend, and sets of W clients (one per rank), each set joined in its own
/// group. Set 0 submits through the rings; AddClients adds a set on either path.
class Cluster {
 public:
  ~Cluster() { (void)Stop(); }

  /// Starts the daemons (`daemon_args` appended to each command line, `daemon_env` entries
  /// "NAME=value" replacing those of this process's environment) and connects set 0 (rings on;
  /// an error if the daemon offers none, or runs another backend).
  absl::Status Start(const std::string& ulyssesd, const std::string& dir, int world,
                     const std::string& backend = "host",
                     const std::vector<std::string>& daemon_args = {},
                     const std::vector<std::string>& daemon_env = {});
  /// Connects another set of W clients with rings on or off and joins them in a new group;
  /// returns the set's index.
  absl::StatusOr<int> AddClients(bool use_rings);
  /// Closes the clients, then stops the daemons (SIGTERM); an unclean exit is an error.
  /// Idempotent.
  absl::Status Stop();

  int world() const { return world_; }
  const std::vector<std::string>& members() const { return members_; }
  client::Client& client(int r, int set = 0) { return *sets_[set].clients[r]; }
  const client::Group& group(int r, int set = 0) const { return sets_[set].groups[r]; }

 private:
  struct ClientSet {
    std::vector<std::unique_ptr<client::Client>> clients;
    std::vector<client::Group> groups;
  };
  int world_ = 0;
  std::string backend_;
  std::vector<std::string> members_;
  std::vector<demo::DaemonProcess> daemons_;
  std::vector<ClientSet> sets_;
};

}  // namespace ulysses::bench
