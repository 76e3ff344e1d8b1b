// The Prometheus text exposition format (0.0.4) as ulyssesctl reads it: one sample per line,
// comments (# HELP, # TYPE and any other) and blank lines skipped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace ulysses::ctl {

/// One sample line: `name{label="value",...} value [timestamp_ms]`.
struct MetricSample {
  std::string name;
  /// In the order of the line; values unescaped (\\, \" and \n).
  std::vector<std::pair<std::string, std::string>> labels;
  /// NaN, +Inf and -Inf included.
  double value = 0.0;
  std::optional<std::int64_t> timestamp_ms;
};

/// Parses every sample of `text` into `samples` (in the order of the text). On the first
/// malformed line returns false with `error` set to "line N: what is wrong"; `samples` then
/// holds the samples before it.
bool ParseMetricsText(std::string_view text, std::vector<MetricSample>* samples,
                      std::string* error);

/// {"metrics": [{"name": ..., "labels": {...}, "value": ...}, ...]}: values are numbers, or
/// the strings "NaN", "+Inf" and "-Inf" (JSON has no such numbers); "timestamp_ms" is present
/// only on samples that carry one.
nlohmann::json MetricsToJson(const std::vector<MetricSample>& samples);

}  // namespace ulysses::ctl
