#include "ulysses/common/logging.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>

#include "ulysses/common/strings.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace ulysses {
namespace {

std::mutex& LoggingMutex() {
  static std::mutex mu;
  return mu;
}

std::atomic<uint64_t> g_lines_dropped{0};

spdlog::level::level_enum& CurrentLevel() {
  static spdlog::level::level_enum level = spdlog::level::info;
  return level;
}

}  // namespace

absl::Status SetLogLevel(std::string_view level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off")
    return absl::InvalidArgumentError(StrCat(
        "log_level: '", level, "' is not one of trace, debug, info, warn, error, off"));
  std::lock_guard<std::mutex> lock(LoggingMutex());
  CurrentLevel() = parsed;
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) { l->set_level(parsed); });
  return absl::OkStatus();
}

std::shared_ptr<spdlog::logger> Logger(std::string_view subsystem) {
  std::lock_guard<std::mutex> lock(LoggingMutex());
  std::string name(subsystem);
  if (auto existing = spdlog::get(name)) return existing;
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] pid=%P %v");
  logger->set_level(CurrentLevel());
  return logger;
}

bool LogBudget::Take(uint64_t* dropped, absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refilled_ == absl::InfinitePast()) {
    refilled_ = now;
  } else if (now > refilled_) {
    tokens_ = std::min<double>(burst_, tokens_ + absl::FDivDuration(now - refilled_, every_));
    refilled_ = now;
  }
  if (tokens_ < 1) {
    ++dropped_;
    g_lines_dropped.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  tokens_ -= 1;
  if (dropped != nullptr) *dropped = dropped_;
  dropped_ = 0;
  return true;
}

std::string DroppedNote(uint64_t dropped) {
  return dropped == 0 ? std::string() : StrCat(" (", dropped, " more such lines not logged)");
}

uint64_t LogLinesDropped() { return g_lines_dropped.load(std::memory_order_relaxed); }

}  // namespace ulysses
