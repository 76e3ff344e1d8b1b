#include "ulyssesctl/metrics.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "ulysses/common/strings.h"

namespace ulysses::ctl {
namespace {

bool IsBlank(char c) { return c == ' ' || c == '\t'; }
bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Reads one line's tokens; every method returns false with `error` set when the line is
// malformed.
class LineParser {
 public:
  explicit LineParser(std::string_view line) : s_(line) {}

  bool Parse(MetricSample* out, std::string* error) {
    if (!Name(/*metric=*/true, &out->name)) return Fail("expected a metric name", error);
    bool blank = SkipBlanks();
    if (Peek() == '{') {
      ++pos_;
      if (!Labels(&out->labels, error)) return false;
      SkipBlanks();
      blank = true;  // "name{...}1" is as good as "name{...} 1"
    }
    if (AtEnd()) return Fail("expected a value", error);
    if (!blank) return Fail("expected blanks after the metric name", error);
    if (!Value(&out->value)) return Fail("bad value", error);
    const bool blank_after_value = SkipBlanks();
    if (AtEnd()) return true;
    if (!blank_after_value) return Fail("bad value", error);
    std::int64_t ts = 0;
    if (!Timestamp(&ts)) return Fail("bad timestamp", error);
    out->timestamp_ms = ts;
    SkipBlanks();
    if (!AtEnd()) return Fail("unexpected text after the timestamp", error);
    return true;
  }

 private:
  bool AtEnd() const { return pos_ >= s_.size(); }
  char Peek() const { return AtEnd() ? '\0' : s_[pos_]; }
  // True when at least one blank was skipped.
  bool SkipBlanks() {
    const std::size_t start = pos_;
    while (!AtEnd() && IsBlank(s_[pos_])) ++pos_;
    return pos_ > start;
  }
  bool Fail(std::string_view what, std::string* error) const {
    *error = StrCat(what, " at column ", pos_ + 1);
    return false;
  }

  // Metric names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: [a-zA-Z_][a-zA-Z0-9_]*.
  bool Name(bool metric, std::string* out) {
    const std::size_t start = pos_;
    auto ok = [&](char c, bool first) {
      return IsAlpha(c) || c == '_' || (metric && c == ':') || (!first && IsDigit(c));
    };
    while (!AtEnd() && ok(s_[pos_], pos_ == start)) ++pos_;
    if (pos_ == start) return false;
    out->assign(s_.substr(start, pos_ - start));
    return true;
  }

  // After '{': `name="value"` pairs separated by commas (a trailing comma allowed), then '}'.
  bool Labels(std::vector<std::pair<std::string, std::string>>* out, std::string* error) {
    while (true) {
      SkipBlanks();
      if (Peek() == '}') {
        ++pos_;
        return true;
      }
      std::string name;
      if (!Name(/*metric=*/false, &name)) return Fail("expected a label name or '}'", error);
      SkipBlanks();
      if (Peek() != '=') return Fail("expected '=' after the label name", error);
      ++pos_;
      SkipBlanks();
      if (Peek() != '"') return Fail("expected '\"' to open the label value", error);
      ++pos_;
      std::string value;
      while (true) {
        if (AtEnd()) return Fail("unterminated label value", error);
        const char c = s_[pos_++];
        if (c == '"') break;
        if (c != '\\') {
          value += c;
          continue;
        }
        if (AtEnd()) return Fail("unterminated label value", error);
        const char e = s_[pos_++];
        if (e == 'n') {
          value += '\n';
        } else if (e == '\\' || e == '"') {
          value += e;
        } else {  // not an escape the format defines: keep it as written
          value += '\\';
          value += e;
        }
      }
      out->emplace_back(std::move(name), std::move(value));
      SkipBlanks();
      if (Peek() == ',') {
        ++pos_;
      } else if (Peek() != '}') {
        return Fail("expected ',' or '}' after the label value", error);
      }
    }
  }

  std::string_view Token() {
    const std::size_t start = pos_;
    while (!AtEnd() && !IsBlank(s_[pos_])) ++pos_;
    return s_.substr(start, pos_ - start);
  }

  // Go's ParseFloat syntax, as Prometheus writes it: decimals, exponents, NaN, +Inf, -Inf.
  bool Value(double* out) {
    const std::size_t start = pos_;
    const std::string token(Token());
    if (token.empty()) return false;
    char* end = nullptr;
    *out = std::strtod(token.c_str(), &end);
    if (end != token.c_str() + token.size()) {
      pos_ = start;
      return false;
    }
    return true;
  }

  bool Timestamp(std::int64_t* out) {
    const std::size_t start = pos_;
    const std::string_view token = Token();
    const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), *out);
    if (token.empty() || ec != std::errc() || ptr != token.data() + token.size()) {
      pos_ = start;
      return false;
    }
    return true;
  }

  std::string_view s_;
  std::size_t pos_ = 0;
};

}  // namespace

bool ParseMetricsText(std::string_view text, std::vector<MetricSample>* samples,
                      std::string* error) {
  std::size_t line_number = 0;
  while (!text.empty()) {
    ++line_number;
    const std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::size_t first = 0;
    while (first < line.size() && IsBlank(line[first])) ++first;
    line.remove_prefix(first);
    if (line.empty() || line.front() == '#') continue;
    MetricSample sample;
    std::string why;
    if (!LineParser(line).Parse(&sample, &why)) {
      *error = StrCat("line ", line_number, ": ", why);
      return false;
    }
    samples->push_back(std::move(sample));
  }
  return true;
}

nlohmann::json MetricsToJson(const std::vector<MetricSample>& samples) {
  nlohmann::json metrics = nlohmann::json::array();
  for (const auto& s : samples) {
    nlohmann::json labels = nlohmann::json::object();
    for (const auto& [name, value] : s.labels) labels[name] = value;
    nlohmann::json value;
    if (std::isnan(s.value)) {
      value = "NaN";
    } else if (std::isinf(s.value)) {
      value = s.value > 0 ? "+Inf" : "-Inf";
    } else {
      value = s.value;
    }
    nlohmann::json m = {
        {"name", s.name}, {"labels", std::move(labels)}, {"value", std::move(value)}};
    if (s.timestamp_ms) m["timestamp_ms"] = *s.timestamp_ms;
    metrics.push_back(std::move(m));
  }
  return nlohmann::json{{"metrics", std::move(metrics)}};
}

}  // namespace ulysses::ctl
