#include "ulyssesctl/metrics.h"

#include <cmath>
#include <string>
#include <vector>

#include "ctl_test_util.h"
#include "gtest/gtest.h"

namespace ulysses::ctl {
namespace {

using nlohmann::json;
using Labels = std::vector<std::pair<std::string, std::string>>;

std::vector<MetricSample> MustParse(std::string_view text) {
  std::vector<MetricSample> samples;
  std::string error;
  EXPECT_TRUE(ParseMetricsText(text, &samples, &error)) << error;
  return samples;
}

std::string ParseError(std::string_view text) {
  std::vector<MetricSample> samples;
  std::string error;
  EXPECT_FALSE(ParseMetricsText(text, &samples, &error)) << text;
  return error;
}

TEST(MetricsTest, SampleExpositionWithLabelsAndHistogram) {
  const auto samples = MustParse(testing::SampleMetricsText());
  ASSERT_EQ(samples.size(), 10u);
  EXPECT_EQ(samples[0].name, "ulysses_calls_total");
  EXPECT_EQ(samples[0].labels, (Labels{{"op", "scatter_heads"}, {"status", "OK"}}));
  EXPECT_EQ(samples[0].value, 40.0);
  EXPECT_FALSE(samples[0].timestamp_ms.has_value());
  EXPECT_EQ(samples[1].labels, (Labels{{"op", "gather_heads"}, {"status", "DEADLINE_EXCEEDED"}}));

  // The histogram: buckets (le up to +Inf, a label), then _sum and _count.
  const std::vector<std::string> les = {"0.001", "0.01", "+Inf"};
  const std::vector<double> counts = {30, 39, 40};
  for (int i = 0; i < 3; ++i) {
    const auto& b = samples[2 + i];
    EXPECT_EQ(b.name, "ulysses_call_seconds_bucket");
    EXPECT_EQ(b.labels, (Labels{{"op", "scatter_heads"}, {"le", les[i]}}));
    EXPECT_EQ(b.value, counts[i]);
  }
  EXPECT_EQ(samples[5].name, "ulysses_call_seconds_sum");
  EXPECT_DOUBLE_EQ(samples[5].value, 0.123);
  EXPECT_EQ(samples[6].name, "ulysses_call_seconds_count");
  EXPECT_EQ(samples[6].value, 40.0);

  EXPECT_EQ(samples[7].name, "ulysses_draining");
  EXPECT_TRUE(samples[7].labels.empty());
  EXPECT_EQ(samples[8].value, 1.7e9);
  EXPECT_EQ(samples[8].timestamp_ms, 1'700'000'000'123LL);
  EXPECT_EQ(samples[9].labels,
            (Labels{{"name", "say \"hi\""}, {"path", "C:\\tmp"}, {"note", "a\nb"}}));
}

TEST(MetricsTest, Json) {
  const json j = MetricsToJson(MustParse(testing::SampleMetricsText()));
  ASSERT_EQ(j.size(), 1u);
  const json& m = j.at("metrics");
  ASSERT_EQ(m.size(), 10u);
  EXPECT_EQ(m[4], json::parse(R"({"name":"ulysses_call_seconds_bucket",
                                   "labels":{"op":"scatter_heads","le":"+Inf"},"value":40})"));
  EXPECT_EQ(m[7], json::parse(R"({"name":"ulysses_draining","labels":{},"value":1})"));
  EXPECT_EQ(m[8]["timestamp_ms"], 1'700'000'000'123LL);
  EXPECT_FALSE(m[7].contains("timestamp_ms"));
  EXPECT_EQ(m[9]["labels"]["note"], "a\nb");
  EXPECT_EQ(MetricsToJson({}), json::parse(R"({"metrics":[]})"));
}

TEST(MetricsTest, NonFiniteValuesAreStringsInJson) {
  const auto samples = MustParse("a NaN\nb +Inf\nc -Inf\nd Inf\ne -0.5e-3\n");
  ASSERT_EQ(samples.size(), 5u);
  EXPECT_TRUE(std::isnan(samples[0].value));
  EXPECT_EQ(samples[1].value, INFINITY);
  EXPECT_EQ(samples[2].value, -INFINITY);
  EXPECT_EQ(samples[3].value, INFINITY);
  EXPECT_DOUBLE_EQ(samples[4].value, -0.0005);
  const json m = MetricsToJson(samples)["metrics"];
  EXPECT_EQ(m[0]["value"], "NaN");
  EXPECT_EQ(m[1]["value"], "+Inf");
  EXPECT_EQ(m[2]["value"], "-Inf");
  EXPECT_EQ(m[3]["value"], "+Inf");
  EXPECT_DOUBLE_EQ(m[4]["value"].get<double>(), -0.0005);
  // Serializable: no NaN sneaks into the document as null.
  EXPECT_EQ(m.dump().find("null"), std::string::npos);
}

TEST(MetricsTest, BlanksCommentsAndLineEndings) {
  const auto samples = MustParse(
      "\n   \n# a comment that is neither HELP nor TYPE\n"
      "  indented{ a = \"1\" , b=\"2\", }\t 3 \t\r\n"
      "no_newline_at_end:total 4 -5");
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].name, "indented");
  EXPECT_EQ(samples[0].labels, (Labels{{"a", "1"}, {"b", "2"}}));
  EXPECT_EQ(samples[0].value, 3.0);
  EXPECT_EQ(samples[1].name, "no_newline_at_end:total");
  EXPECT_EQ(samples[1].timestamp_ms, -5);
  EXPECT_TRUE(MustParse("").empty());
  EXPECT_TRUE(MustParse("# HELP x y\n# TYPE x counter\n").empty());
  EXPECT_EQ(MustParse("empty{} 1")[0].labels, Labels{});
}

TEST(MetricsTest, MalformedLinesNameTheLine) {
  EXPECT_EQ(ParseError("ok 1\n{a=\"b\"} 1\n").rfind("line 2: expected a metric name", 0), 0u);
  EXPECT_EQ(ParseError("x\n").rfind("line 1: expected a value", 0), 0u);
  EXPECT_EQ(ParseError("x{a=\"b\"}\n").rfind("line 1: expected a value", 0), 0u);
  EXPECT_EQ(ParseError("x one\n").rfind("line 1: bad value", 0), 0u);
  EXPECT_EQ(ParseError("x 1 2.5\n").rfind("line 1: bad timestamp", 0), 0u);
  EXPECT_EQ(ParseError("x 1 2 3\n").rfind("line 1: unexpected text", 0), 0u);
  EXPECT_EQ(ParseError("x{a=\"b} 1\n").rfind("line 1: unterminated label value", 0), 0u);
  EXPECT_EQ(ParseError("x{a=b} 1\n").rfind("line 1: expected '\"'", 0), 0u);
  EXPECT_EQ(ParseError("x{a\"b\"} 1\n").rfind("line 1: expected '='", 0), 0u);
  EXPECT_EQ(ParseError("x{a=\"b\" c=\"d\"} 1\n").rfind("line 1: expected ',' or '}'", 0), 0u);
  EXPECT_EQ(ParseError("x{1a=\"b\"} 1\n").rfind("line 1: expected a label name", 0), 0u);
  EXPECT_EQ(ParseError("x-1\n").rfind("line 1: expected blanks", 0), 0u);
}

}  // namespace
}  // namespace ulysses::ctl
