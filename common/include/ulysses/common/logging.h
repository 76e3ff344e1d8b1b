// Logging setup: one named spdlog logger per subsystem (main, grpc, ipc, exec, kern, peer).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace ulysses {

/// Sets the level of every logger ("trace", "debug", "info", "warn", "error", "off").
/// Thread-safe. INVALID_ARGUMENT names `log_level` for an unknown level.
absl::Status SetLogLevel(std::string_view level);

/// Returns the named logger, creating it (stderr, shared format) on first use. Thread-safe.
std::shared_ptr<spdlog::logger> Logger(std::string_view subsystem);

/// The log lines of one source that a peer can make the daemon write at will (a client's bad
/// frames and refused calls, a socket's refused connections): `burst` lines at once, then one
/// more each `every`; the lines past the budget are counted, not written, so that no client
/// can fill the daemon's log. Thread-safe.
class LogBudget {
 public:
  static constexpr int kBurst = 5;
  static constexpr absl::Duration kEvery = absl::Seconds(10);

  explicit LogBudget(int burst = kBurst, absl::Duration every = kEvery)
      : burst_(burst), every_(every), tokens_(burst) {}

  /// Whether one more line may be written at `now`. When it may, `*dropped` (if given) is set
  /// to the count of this source's lines not written since the last one that was.
  bool Take(uint64_t* dropped = nullptr, absl::Time now = absl::Now());

 private:
  const int burst_;
  const absl::Duration every_;
  std::mutex mu_;
  double tokens_;
  absl::Time refilled_ = absl::InfinitePast();
  uint64_t dropped_ = 0;
};

/// " (N more such lines not logged)" for N > 0, else "": the tail of a line a LogBudget let
/// through.
std::string DroppedNote(uint64_t dropped);

/// A warning through `log` when `budget` lets one more line through (formatted only then),
/// ending with DroppedNote.
template <typename... Args>
void WarnWithin(LogBudget& budget, spdlog::logger& log, spdlog::format_string_t<Args...> format,
                Args&&... args) {
  uint64_t dropped = 0;
  if (!budget.Take(&dropped)) return;
  log.warn("{}{}", fmt::format(format, std::forward<Args>(args)...), DroppedNote(dropped));
}

/// Lines every LogBudget of this process kept from the log (the metric
/// ulyssesd_log_lines_dropped_total).
uint64_t LogLinesDropped();

}  // namespace ulysses
