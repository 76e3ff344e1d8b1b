#include "ulyssesctl/format.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ctl_test_util.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"

namespace ulysses::ctl {
namespace {

using nlohmann::json;
using testing::kNowUnixMs;

// Sets $TZ for the scope (and back after).
class ScopedTz {
 public:
  explicit ScopedTz(const char* tz) {
    if (const char* old = std::getenv("TZ"); old != nullptr) old_ = old;
    ::setenv("TZ", tz, 1);
    ::tzset();
  }
  ~ScopedTz() {
    if (old_) {
      ::setenv("TZ", old_->c_str(), 1);
    } else {
      ::unsetenv("TZ");
    }
    ::tzset();
  }
  ScopedTz(const ScopedTz&) = delete;
  ScopedTz& operator=(const ScopedTz&) = delete;

 private:
  std::optional<std::string> old_;
};

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Column of `header` in the header line, and the checks that every row's cell of that column
// starts (left) or ends (right) exactly where the header does.
void ExpectAligned(const std::string& table, const std::string& header, Align align) {
  const auto lines = Lines(table);
  ASSERT_FALSE(lines.empty());
  const std::string padded = " " + lines[0] + " ";
  const auto at = padded.find(" " + header + " ");
  ASSERT_NE(at, std::string::npos) << header << " not in header: " << lines[0];
  const std::size_t start = at;  // index in lines[0]
  const std::size_t end = start + header.size();
  for (std::size_t i = 1; i < lines.size(); ++i) {
    const std::string& row = lines[i];
    SCOPED_TRACE(row);
    if (align == Align::kLeft) {
      ASSERT_GT(row.size(), start);
      EXPECT_NE(row[start], ' ');
      if (start > 0) {
        EXPECT_EQ(row[start - 1], ' ');
      }
    } else {
      ASSERT_GE(row.size(), end);
      EXPECT_NE(row[end - 1], ' ');
      if (end < row.size()) {
        EXPECT_EQ(row[end], ' ');
      }
    }
  }
}

TEST(TableTest, PadsColumnsToTheWidestCellAndPrintsTheHeaderFirst) {
  Table t({{"NAME"}, {"COUNT", Align::kRight}, {"NOTE"}});
  t.AddRow({"a", "1", "x"});
  t.AddRow({"longer-name", "12345", "y z"});
  EXPECT_EQ(t.Render(),
            "NAME         COUNT  NOTE\n"
            "a                1  x\n"
            "longer-name  12345  y z\n");
  EXPECT_EQ(t.num_rows(), 2u);
}

TEST(TableTest, RightAlignedHeaderFollowsItsCells) {
  Table t({{"ID", Align::kRight}, {"NAME"}});
  t.AddRow({"1234", "n"});
  EXPECT_EQ(t.Render(),
            "  ID  NAME\n"
            "1234  n\n");
}

TEST(TableTest, EmptyCellsPrintDashAndCellsStayOnOneLine) {
  Table t({{"A"}, {"B"}, {"C"}});
  t.AddRow({"", "two\nlines", "\ttab "});
  t.AddRow({"x"});  // missing cells
  const std::string out = t.Render();
  EXPECT_EQ(out,
            "A  B          C\n"
            "-  two lines  tab\n"
            "x  -          -\n");
  for (const auto& line : Lines(out)) EXPECT_NE(line.back(), ' ') << "trailing blank: " << line;
}

TEST(TableTest, HeaderOnlyWithoutRows) {
  Table t({{"SESSION", Align::kRight}, {"STATE"}});
  EXPECT_EQ(t.Render(), "SESSION  STATE\n");
}

TEST(TableTest, MultiByteCharactersCountAsOneColumn) {
  Table t({{"NAME"}, {"X"}});
  t.AddRow({"h\xC3\xA9llo", "1"});  // "héllo": 5 columns, 6 bytes
  t.AddRow({"hello", "2"});
  const auto lines = Lines(t.Render());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], "h\xC3\xA9llo  1");
  EXPECT_EQ(lines[2], "hello  2");
}

TEST(TableTest, KeyValuesAlignValues) {
  EXPECT_EQ(RenderKeyValues({{"a", "1"}, {"longer", "two words"}, {"empty", ""}}),
            "a:       1\n"
            "longer:  two words\n"
            "empty:   -\n");
}

TEST(UnitsTest, FormatBytes) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.0 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(13107200), "12.5 MiB");
  EXPECT_EQ(FormatBytes(1048575), "1.0 MiB");  // 1023.999 KiB does not print as "1024.0 KiB"
  EXPECT_EQ(FormatBytes(3ULL << 30), "3.0 GiB");
  EXPECT_EQ(FormatBytes(5ULL << 40), "5.0 TiB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<std::uint64_t>::max()), "16384.0 PiB");
}

TEST(UnitsTest, FormatDuration) {
  EXPECT_EQ(FormatDuration(-1.0), "0ms");
  EXPECT_EQ(FormatDuration(0.0), "0ms");
  EXPECT_EQ(FormatDuration(std::nan("")), "0ms");
  EXPECT_EQ(FormatDuration(0.0004), "0ms");
  EXPECT_EQ(FormatDuration(0.85), "850ms");
  EXPECT_EQ(FormatDuration(0.9996), "1.0s");
  EXPECT_EQ(FormatDuration(3.2), "3.2s");
  EXPECT_EQ(FormatDuration(59.94), "59.9s");
  EXPECT_EQ(FormatDuration(59.96), "1m00s");
  EXPECT_EQ(FormatDuration(312.0), "5m12s");
  EXPECT_EQ(FormatDuration(3725.0), "1h02m");
  EXPECT_EQ(FormatDuration(11100.0), "3h05m");
  EXPECT_EQ(FormatDuration(2 * 86400.0 + 3 * 3600.0 + 59.0), "2d03h");
}

TEST(UnitsTest, FormatAgeMs) {
  EXPECT_EQ(FormatAgeMs(250), "250ms");
  EXPECT_EQ(FormatAgeMs(3200), "3.2s");
  EXPECT_EQ(FormatAgeMs(90'000), "1m30s");
  EXPECT_EQ(FormatAgeMs(-5), "0ms");
}

TEST(UnitsTest, FormatDurationUs) {
  EXPECT_EQ(FormatDurationUs(-3), "0us");
  EXPECT_EQ(FormatDurationUs(0), "0us");
  EXPECT_EQ(FormatDurationUs(850), "850us");
  EXPECT_EQ(FormatDurationUs(999), "999us");
  EXPECT_EQ(FormatDurationUs(1000), "1ms");
  EXPECT_EQ(FormatDurationUs(12'000), "12ms");
  EXPECT_EQ(FormatDurationUs(3'200'000), "3.2s");
  EXPECT_EQ(FormatDurationUs(312'000'000), "5m12s");
}

TEST(UnitsTest, FormatLocalTimeUsInUtcIsRfc3339WithZ) {
  ScopedTz tz("UTC");
  EXPECT_EQ(FormatLocalTimeUs(0), "-");
  EXPECT_EQ(FormatLocalTimeUs(testing::kCallUnixUs), "2023-11-14T22:13:20.123Z");
  EXPECT_EQ(FormatLocalTimeUs(1'000'999), "1970-01-01T00:00:01.000Z");  // truncated, not rounded
  EXPECT_EQ(FormatLocalTimeUs(-1), "1969-12-31T23:59:59.999Z");
}

TEST(UnitsTest, FormatLocalTimeUsCarriesTheZoneOffset) {
  {
    ScopedTz tz("XYZ-2");  // POSIX: two hours east of UTC
    EXPECT_EQ(FormatLocalTimeUs(testing::kCallUnixUs), "2023-11-15T00:13:20.123+02:00");
  }
  ScopedTz tz("ABC+5:30");  // five and a half hours west
  EXPECT_EQ(FormatLocalTimeUs(testing::kCallUnixUs), "2023-11-14T16:43:20.123-05:30");
}

TEST(UnitsTest, FormatUtcTimeUsIsRfc3339WithMicroseconds) {
  ScopedTz tz("XYZ-2");  // the local zone does not matter
  EXPECT_EQ(FormatUtcTimeUs(testing::kCallUnixUs), "2023-11-14T22:13:20.123456Z");
  EXPECT_EQ(FormatUtcTimeUs(-1), "1969-12-31T23:59:59.999999Z");
  EXPECT_EQ(FormatUtcTimeUs(0), "");
}

TEST(UnitsTest, DTypeName) {
  EXPECT_EQ(DTypeName(v1::DTYPE_UNSPECIFIED), "-");
  EXPECT_EQ(DTypeName(v1::DTYPE_FLOAT16), "float16");
  EXPECT_EQ(DTypeName(v1::DTYPE_BFLOAT16), "bfloat16");
  EXPECT_EQ(DTypeName(v1::DTYPE_FLOAT32), "float32");
  EXPECT_EQ(DTypeName(99), "dtype(99)");
}

// The key of a field under the documented naming scheme: Unix times `*_time`, durations
// `*_seconds`, everything else the field's name.
std::string SchemeKey(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const char* unix_suffix : {"_unix_ms", "_unix_us"})
    if (ends(unix_suffix)) return name.substr(0, name.size() - 8) + "_time";
  for (const std::string unit : {"_ms", "_us", "_s"})
    if (ends(unit)) return name.substr(0, name.size() - unit.size()) + "_seconds";
  return name;
}

// Every field of `descriptor` (and of nested messages, in their first element for repeated
// ones) is a key of `j`, named by the scheme; a listing's paging token is not printed (every
// page is read into one document).
void ExpectEveryField(const json& j, const google::protobuf::Descriptor& descriptor,
                      const std::string& where) {
  ASSERT_TRUE(j.is_object()) << where;
  const bool paged = descriptor.FindFieldByName("next_page_token") != nullptr;
  EXPECT_EQ(j.size(), static_cast<std::size_t>(descriptor.field_count() - (paged ? 1 : 0)))
      << where;
  EXPECT_FALSE(j.contains("next_page_token")) << where;
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const auto& f = *descriptor.field(i);
    if (f.name() == "next_page_token") continue;
    const std::string key = SchemeKey(f.name());
    const std::string path = where + "." + key;
    ASSERT_TRUE(j.contains(key)) << path << " missing";
    const json& v = j.at(key);
    if (f.is_repeated()) {
      ASSERT_TRUE(v.is_array()) << path;
      if (f.message_type() != nullptr && !v.empty()) ExpectEveryField(v[0], *f.message_type(), path);
    } else if (f.message_type() != nullptr) {
      ExpectEveryField(v, *f.message_type(), path);
    }
  }
}

TEST(JsonTest, StateHasEveryFieldWithItsValue) {
  const json j = StateToJson(testing::SampleState());
  ExpectEveryField(j, *v1::DaemonState::descriptor(), "state");
  EXPECT_EQ(j["version"], "0.1.0");
  EXPECT_EQ(j["device"], 3);
  EXPECT_EQ(j["backend"], "host");
  EXPECT_EQ(j["pid"], 4242);
  EXPECT_DOUBLE_EQ(j["uptime_seconds"].get<double>(), 3725.0);
  EXPECT_EQ(j["device_uuid"], "GPU-8f6c1b2e-0c3d-4a5b-9e7f-112233445566");
  EXPECT_EQ(j["device_pci_bus_id"], "0000:18:00.0");
  EXPECT_EQ(j["device_numa_node"], 1);
  EXPECT_EQ(j["draining"], true);
  EXPECT_EQ(j["health"], "SERVING");
  EXPECT_EQ(j["num_clients"], 2);
  EXPECT_EQ(j["num_groups"], 1);
  EXPECT_EQ(j["num_sessions"], 1);
  EXPECT_EQ(j["socket"], "/run/ulysses/gpu3.sock");
  ASSERT_TRUE(j["calls_total"].is_number_unsigned());  // a number, not proto3-JSON's string
  EXPECT_EQ(j["calls_total"].get<std::uint64_t>(), 9'000'000'000ULL);
  EXPECT_EQ(j["calls_failed"], 7);
}

TEST(JsonTest, DefaultValuesArePrinted) {
  const json j = StateToJson(v1::DaemonState());
  ExpectEveryField(j, *v1::DaemonState::descriptor(), "state");
  EXPECT_EQ(j["version"], "");
  EXPECT_EQ(j["draining"], false);
  EXPECT_EQ(j["calls_total"], 0);
  // The GPU identity is unknown until set: null, not an empty string or NUMA node 0.
  EXPECT_TRUE(j["device_uuid"].is_null()) << j;
  EXPECT_TRUE(j["device_pci_bus_id"].is_null()) << j;
  EXPECT_TRUE(j["device_numa_node"].is_null()) << j;
  EXPECT_EQ(ClientsToJson(v1::ListClientsResponse()), json::parse(R"({"clients":[]})"));
}

TEST(JsonTest, ClientsIsAnObjectWithAnArray) {
  const json j = ClientsToJson(testing::SampleClients());
  ExpectEveryField(j, *v1::ListClientsResponse::descriptor(), "clients");
  ASSERT_EQ(j["clients"].size(), 2u);
  const json& a = j["clients"][0];
  EXPECT_EQ(a["client_id"], 1);
  EXPECT_EQ(a["name"], "trainer-rank0");
  EXPECT_EQ(a["pid"], 1001);
  EXPECT_EQ(a["uid"], 1000);
  EXPECT_EQ(a["since_time"], "2023-11-14T22:13:16.800000Z");  // kNowUnixMs - 3.2 s
  EXPECT_EQ(a["num_buffers"], 4);
  EXPECT_EQ(a["buffer_bytes"], 13107200);
  EXPECT_EQ(a["num_sessions"], 1);
  EXPECT_EQ(a["calls"], 123);
  EXPECT_EQ(j["clients"][1]["client_id"], 22);
  EXPECT_EQ(j["clients"][1]["calls"].get<std::uint64_t>(), 18'446'744'073'709'551'615ULL);
}

TEST(JsonTest, GroupsNestInfoAndListMembers) {
  const json j = GroupsToJson(testing::SampleGroups());
  ExpectEveryField(j, *v1::ListGroupsResponse::descriptor(), "groups");
  ASSERT_EQ(j["groups"].size(), 1u);
  const json& g = j["groups"][0];
  EXPECT_EQ(g["client_ids"], json::parse("[1,22]"));
  const json& i = g["info"];
  EXPECT_EQ(i["group_id"], 7);
  EXPECT_EQ(i["name"], "tp0");
  EXPECT_EQ(i["world_size"], 2);
  EXPECT_EQ(i["rank"], 1);
  EXPECT_EQ(i["backend"], "host");
  EXPECT_EQ(i["backend_reason"], "no CUDA device");
  EXPECT_EQ(i["members"],
            json::parse(R"(["unix:///run/ulysses/gpu0.sock","unix:///run/ulysses/gpu1.sock"])"));
}

TEST(JsonTest, SessionsNestSpecWithEnumNames) {
  const json j = SessionsToJson(testing::SampleSessions());
  ExpectEveryField(j, *v1::ListSessionsResponse::descriptor(), "sessions");
  ASSERT_EQ(j["sessions"].size(), 1u);
  const json& s = j["sessions"][0];
  EXPECT_EQ(s["owner_client_id"], 1);
  EXPECT_EQ(s["kind"], "head_exchange");
  EXPECT_EQ(s["calls"], 40);
  EXPECT_EQ(s["last_epoch"], 41);
  const json& i = s["info"];
  EXPECT_EQ(i["session_id"], 5);
  EXPECT_EQ(i["group_id"], 7);
  EXPECT_EQ(i["world_size"], 2);
  EXPECT_EQ(i["rank"], 1);
  EXPECT_EQ(i["slot_bytes"], 33554432);
  EXPECT_EQ(i["slot_stride_bytes"], 33558528);
  EXPECT_EQ(i["slot_offset_bytes"], 4096);
  EXPECT_EQ(i["segment_bytes"], 67121152);
  EXPECT_EQ(i["backend"], "host");
  EXPECT_EQ(i["backend_reason"], "no CUDA device");
  const json& spec = i["spec"];
  EXPECT_EQ(spec["num_heads"], 32);
  EXPECT_EQ(spec["head_dim"], 128);
  EXPECT_EQ(spec["dtype"], "bfloat16");  // the spelling of tables and options
  EXPECT_EQ(spec["max_tokens"], 8192);
  EXPECT_EQ(spec["num_slots"], 2);
  EXPECT_EQ(spec["schedule"], json::parse("[7,9]"));
}

TEST(JsonTest, UnknownEnumNumberPrintsAsNumber) {
  v1::SessionSpec spec;
  spec.set_dtype(static_cast<v1::DType>(42));
  EXPECT_EQ(MessageToJson(spec)["dtype"], 42);
}

TEST(JsonTest, Slots) {
  const json j = SlotsToJson(testing::SampleSlots());
  ExpectEveryField(j, *v1::ListSlotsResponse::descriptor(), "slots");
  ASSERT_EQ(j["slots"].size(), 2u);
  const json& a = j["slots"][0];
  EXPECT_EQ(a["session_id"], 5);
  EXPECT_EQ(a["slot"], 0);
  EXPECT_EQ(a["state"], "ready");
  EXPECT_EQ(a["owner_client_id"], 1);
  EXPECT_EQ(a["epoch"], 41);
  EXPECT_DOUBLE_EQ(a["age_seconds"].get<double>(), 3.2);
  EXPECT_EQ(j["slots"][1]["state"], "free");
}

TEST(JsonTest, StateHasTheDrainAndMpsFields) {
  const json j = StateToJson(testing::SampleState());
  EXPECT_EQ(j["mps_mode"], "no-mps");
  EXPECT_EQ(j["active_calls"], 2);
  EXPECT_EQ(j["idle"], false);
  EXPECT_EQ(j["metrics_address"], "127.0.0.1:9464");
}

TEST(JsonTest, RecentCallsHaveEveryField) {
  const json j = RecentCallsToJson(testing::SampleRecentCalls());
  ExpectEveryField(j, *v1::ListRecentCallsResponse::descriptor(), "recent");
  EXPECT_EQ(j["capacity"], 256);
  ASSERT_EQ(j["calls"].size(), 3u);
  for (const auto& call : j["calls"]) {
    ExpectEveryField(call, *v1::CallRecord::descriptor(), "recent.calls[]");
  }
  const json& a = j["calls"][0];
  EXPECT_EQ(a["client_id"], 1);
  EXPECT_EQ(a["session_id"], 5);
  EXPECT_EQ(a["epoch"], 41);
  EXPECT_EQ(a["op"], "scatter_heads");
  EXPECT_EQ(a["batch"], 2);
  EXPECT_EQ(a["seq"], 8192);
  EXPECT_EQ(a["queued_time"], "2023-11-14T22:13:20.123456Z");
  EXPECT_EQ(a["started_time"], "2023-11-14T22:13:20.123496Z");
  EXPECT_EQ(a["done_time"], "2023-11-14T22:13:20.124306Z");
  EXPECT_EQ(a["status"], "OK");
  EXPECT_EQ(a["message"], "");
  EXPECT_EQ(a["sent_bytes"], 16'777'216);
  EXPECT_EQ(j["calls"][2]["message"], "peer rank 0 did not answer");
  EXPECT_EQ(RecentCallsToJson(v1::ListRecentCallsResponse()),
            json::parse(R"({"calls":[],"capacity":0})"));
}

TEST(JsonTest, EnumsAreLowerCaseWithoutTheirPrefix) {
  v1::SessionSpec spec;
  spec.set_dtype(v1::DTYPE_FLOAT16);
  EXPECT_EQ(MessageToJson(spec)["dtype"], "float16");
  spec.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(MessageToJson(spec)["dtype"], "unspecified");
}

TEST(JsonTest, UnsetTimesAreNull) {
  v1::CallRecord c;
  const json j = MessageToJson(c);
  EXPECT_TRUE(j["queued_time"].is_null()) << j;
  EXPECT_FALSE(j.contains("queued_unix_us"));
}

TEST(JsonTest, Drain) {
  v1::DrainResponse r;
  r.set_draining(true);
  r.set_active_calls(4);
  r.set_num_sessions(2);
  const json j = DrainToJson(r);
  ExpectEveryField(j, *v1::DrainResponse::descriptor(), "drain");
  EXPECT_EQ(j, json::parse(R"({"draining":true,"idle":false,"active_calls":4,"num_sessions":2})"));
}

TEST(JsonTest, Health) {
  EXPECT_EQ(HealthToJson("SERVING"), json::parse(R"({"status":"SERVING"})"));
}

TEST(RenderTest, State) {
  const auto lines = Lines(RenderState(testing::SampleState()));
  const std::vector<std::string> want = {
      "version:       0.1.0",
      "device:        3",
      "gpu uuid:      GPU-8f6c1b2e-0c3d-4a5b-9e7f-112233445566",
      "pci bus id:    0000:18:00.0",
      "numa node:     1",
      "pid:           4242",
      "socket:        /run/ulysses/gpu3.sock",
      "backend:       host",
      "mps mode:      no-mps",
      "health:        SERVING",
      "draining:      yes",
      "idle:          no",
      "uptime:        1h02m",
      "clients:       2",
      "groups:        1",
      "sessions:      1",
      "calls:         9000000000 (7 failed)",
      "active calls:  2",
      "hw queues:     -",
      "metrics:       127.0.0.1:9464",
  };
  EXPECT_EQ(lines, want);
}

TEST(RenderTest, StateOfAGpuDaemonShowsItsHardwareQueues) {
  v1::DaemonState s = testing::SampleState();
  s.set_hardware_queues(7);
  s.set_hardware_queues_in_use(3);
  EXPECT_NE(RenderState(s).find("\nhw queues:     3 of 7 in use\n"), std::string::npos)
      << RenderState(s);
  s.set_queue_shared_streams(2);
  s.set_queue_refusals(1);
  EXPECT_NE(RenderState(s).find("\nhw queues:     3 of 7 in use, 2 streams on shared "
                                "queues, 1 sessions refused\n"),
            std::string::npos)
      << RenderState(s);
}

TEST(RenderTest, StateOfAHostBackendSaysTheGpuIsUnknown) {
  v1::DaemonState s = testing::SampleState();
  s.clear_device_uuid();
  s.clear_device_pci_bus_id();
  s.clear_device_numa_node();
  const std::string out = RenderState(s);
  for (const char* line : {"\ngpu uuid:      unknown\n", "\npci bus id:    unknown\n",
                           "\nnuma node:     unknown\n"})
    EXPECT_NE(out.find(line), std::string::npos) << line << out;
  const std::string csv = StateListing(s).Render(OutputFormat::kCsv, false);
  EXPECT_NE(csv.find(",3,,,,4242,"), std::string::npos) << csv;  // empty cells in CSV
}

TEST(RenderTest, StateWithoutMetricsEndpointSaysOff) {
  v1::DaemonState s = testing::SampleState();
  s.set_metrics_address("");
  s.set_idle(true);
  s.set_active_calls(0);
  const std::string out = RenderState(s);
  EXPECT_NE(out.find("\nmetrics:       off\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\nidle:          yes\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\nactive calls:  0\n"), std::string::npos) << out;
}

TEST(RenderTest, RecentCallsShowLocalTimesAndDurations) {
  ScopedTz tz("UTC");
  const std::string out = RenderRecentCalls(testing::SampleRecentCalls());
  EXPECT_EQ(out,
            "CLIENT  SESSION  EPOCH  OP                      B         SEQ  "
            "QUEUED                    DURATION  STATUS             MESSAGE\n"
            "     1        5     41  scatter_heads           2        8192  "
            "2023-11-14T22:13:20.123Z     850us  OK                 -\n"
            "    22        6      7  scatter_qkv_head_chunk  1  9000000000  "
            "2023-11-14T22:13:18.623Z      12ms  OK                 -\n"
            "     1        5     40  gather_heads            2        8192  "
            "2023-11-14T22:13:15.123Z      3.2s  DEADLINE_EXCEEDED  peer rank 0 did not answer\n");
  for (const char* h : {"CLIENT", "SESSION", "EPOCH", "B", "SEQ", "DURATION"}) {
    ExpectAligned(out, h, Align::kRight);
  }
  for (const char* h : {"OP", "QUEUED", "STATUS", "MESSAGE"}) ExpectAligned(out, h, Align::kLeft);
}

TEST(RenderTest, RecentCallsWithoutTimesOrClient) {
  ScopedTz tz("UTC");
  v1::ListRecentCallsResponse r;
  auto* c = r.add_calls();
  c->set_session_id(5);
  c->set_op("gather_heads");
  c->set_status("CANCELLED");
  const auto lines = Lines(RenderRecentCalls(r));
  ASSERT_EQ(lines.size(), 2u);
  std::istringstream row(lines[1]);
  const std::vector<std::string> words{std::istream_iterator<std::string>(row),
                                       std::istream_iterator<std::string>()};
  const std::vector<std::string> want = {"-", "5", "0", "gather_heads", "0",
                                         "0", "-", "-", "CANCELLED",   "-"};
  EXPECT_EQ(words, want);
  EXPECT_EQ(RenderRecentCalls(v1::ListRecentCallsResponse()),
            "CLIENT  SESSION  EPOCH  OP  B  SEQ  QUEUED  DURATION  STATUS  MESSAGE\n");
}

TEST(RenderTest, Drain) {
  v1::DrainResponse r;
  r.set_draining(true);
  r.set_idle(true);
  r.set_num_sessions(3);
  EXPECT_EQ(RenderDrain(r), "draining; idle\n");
  r.set_idle(false);
  r.set_active_calls(2);
  EXPECT_EQ(RenderDrain(r), "draining; 2 call(s) running, 3 session(s) open\n");
  r.set_draining(false);  // what undrain prints
  r.set_idle(true);
  EXPECT_EQ(RenderDrain(r), "serving; idle\n");
}

TEST(RenderTest, DrainFromState) {
  const v1::DrainResponse r = DrainFromState(testing::SampleState());
  EXPECT_TRUE(r.draining());
  EXPECT_FALSE(r.idle());
  EXPECT_EQ(r.active_calls(), 2);
  EXPECT_EQ(r.num_sessions(), 1);
}

TEST(RenderTest, ClientsShowAgesAndHumanSizes) {
  const std::string out = RenderClients(testing::SampleClients(), kNowUnixMs);
  const auto lines = Lines(out);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].substr(0, lines[0].find("NAME")), "ID  ");
  EXPECT_NE(lines[1].find("trainer-rank0"), std::string::npos);
  EXPECT_NE(lines[1].find("3.2s"), std::string::npos);
  EXPECT_NE(lines[1].find("12.5 MiB"), std::string::npos);
  EXPECT_NE(lines[2].find("1m30s"), std::string::npos);
  EXPECT_NE(lines[2].find("0 B"), std::string::npos);
  EXPECT_NE(lines[2].find("18446744073709551615"), std::string::npos);
  // A client outside the daemon's PID namespace: the pid it reported, marked as such.
  EXPECT_NE(lines[2].find("777 (reported)"), std::string::npos) << lines[2];
  EXPECT_NE(lines[1].find("1001"), std::string::npos);
  EXPECT_EQ(lines[1].find("(reported)"), std::string::npos) << lines[1];
  for (const char* h : {"ID", "PID", "UID", "AGE", "BUFFERS", "MEMORY", "SESSIONS", "CALLS"}) {
    ExpectAligned(out, h, Align::kRight);
  }
  ExpectAligned(out, "NAME", Align::kLeft);
}

TEST(RenderTest, Groups) {
  const std::string out = RenderGroups(testing::SampleGroups());
  const auto lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "ID  NAME  RANK  WORLD  BACKEND  CLIENTS  REASON");
  EXPECT_EQ(lines[1], " 7  tp0      1      2  host     1,22     no CUDA device");
}

TEST(RenderTest, Sessions) {
  const std::string out = RenderSessions(testing::SampleSessions());
  const auto lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u);
  for (const char* h : {"ID", "GROUP", "OWNER", "HEADS", "HEAD_DIM", "MAX_TOKENS", "SLOTS",
                        "SLOT_SIZE", "SEGMENT", "CALLS", "EPOCH"}) {
    ExpectAligned(out, h, Align::kRight);
  }
  for (const char* h : {"KIND", "DTYPE", "BACKEND"}) ExpectAligned(out, h, Align::kLeft);
  EXPECT_NE(lines[1].find("head_exchange"), std::string::npos);
  EXPECT_NE(lines[1].find("bfloat16"), std::string::npos);
  EXPECT_NE(lines[1].find("32.0 MiB"), std::string::npos);
  EXPECT_NE(lines[1].find("64.0 MiB"), std::string::npos);
}

TEST(RenderTest, SlotsShowDashForNoOwner) {
  const std::string out = RenderSlots(testing::SampleSlots());
  EXPECT_EQ(out,
            "SESSION  SLOT  STATE  OWNER  EPOCH    AGE\n"
            "      5     0  ready      1     41   3.2s\n"
            "      5     1  free       -     40  250ms\n");
}

TEST(OutputFormatTest, ParsesTheFiveNames) {
  EXPECT_EQ(ParseOutputFormat("table"), OutputFormat::kTable);
  EXPECT_EQ(ParseOutputFormat("wide"), OutputFormat::kWide);
  EXPECT_EQ(ParseOutputFormat("json"), OutputFormat::kJson);
  EXPECT_EQ(ParseOutputFormat("yaml"), OutputFormat::kYaml);
  EXPECT_EQ(ParseOutputFormat("csv"), OutputFormat::kCsv);
  EXPECT_EQ(ParseOutputFormat("JSON"), std::nullopt);
  EXPECT_EQ(ParseOutputFormat(""), std::nullopt);
}

TEST(ListingTest, WideAddsColumnsAndCsvHasRawValuesUnderUnitNames) {
  const Listing l = SlotsListing(testing::SampleSlots());
  EXPECT_EQ(l.Render(OutputFormat::kTable, true), RenderSlots(testing::SampleSlots()));
  EXPECT_EQ(l.Render(OutputFormat::kCsv, true),
            "session_id,slot,state,owner_client_id,epoch,age_seconds\n"
            "5,0,ready,1,41,3.2\n"
            "5,1,free,0,40,0.25\n");
  EXPECT_EQ(l.Render(OutputFormat::kCsv, false), "5,0,ready,1,41,3.2\n5,1,free,0,40,0.25\n");
  const std::string table = l.Render(OutputFormat::kTable, false);
  EXPECT_EQ(Lines(table).size(), 2u);
  EXPECT_EQ(table.find("SESSION"), std::string::npos) << table;

  const Listing c = ClientsListing(testing::SampleClients(), kNowUnixMs);
  EXPECT_EQ(c.Render(OutputFormat::kTable, true).find("SINCE"), std::string::npos);
  EXPECT_NE(c.Render(OutputFormat::kWide, true).find("SINCE"), std::string::npos);
  EXPECT_NE(c.Render(OutputFormat::kWide, true).find("REPORTED PID"), std::string::npos);
  const auto csv = Lines(c.Render(OutputFormat::kCsv, true));
  ASSERT_EQ(csv.size(), 3u);
  EXPECT_EQ(csv[0],
            "client_id,name,pid,reported_pid,uid,since_time,age_seconds,num_buffers,buffer_bytes,"
            "num_sessions,calls");
  EXPECT_EQ(csv[1],
            "1,trainer-rank0,1001,1001,1000,2023-11-14T22:13:16.800000Z,3.2,4,13107200,1,123");
  // CSV keeps the raw numbers: the daemon's pid 0 and the reported one apart.
  EXPECT_EQ(csv[2].rfind("22,x,0,777,0,", 0), 0u) << csv[2];
}

TEST(ListingTest, RecentCallsCsvHasUtcTimesAndSecondsAndWideHasTheRest) {
  ScopedTz tz("XYZ-2");
  const Listing l = RecentCallsListing(testing::SampleRecentCalls());
  const auto csv = Lines(l.Render(OutputFormat::kCsv, true));
  ASSERT_EQ(csv.size(), 4u);
  EXPECT_EQ(csv[0],
            "client_id,session_id,epoch,op,batch,seq,queued_time,started_time,enqueued_time,"
            "done_time,duration_seconds,sent_bytes,status,message");
  EXPECT_EQ(csv[1],
            "1,5,41,scatter_heads,2,8192,2023-11-14T22:13:20.123456Z,2023-11-14T22:13:20.123496Z,"
            "2023-11-14T22:13:20.123546Z,2023-11-14T22:13:20.124306Z,0.00085,16777216,OK,");
  const std::string wide = l.Render(OutputFormat::kWide, true);
  for (const char* h : {"STARTED", "ENQUEUED", "DONE", "SENT"})
    EXPECT_NE(Lines(wide)[0].find(h), std::string::npos) << h;
  EXPECT_NE(wide.find("2023-11-15T00:13:20.123+02:00"), std::string::npos) << wide;
}

TEST(CsvTest, QuotesWhatNeedsQuoting) {
  EXPECT_EQ(CsvLine({"a", "b c", ""}), "a,b c,\n");
  EXPECT_EQ(CsvLine({"x,y", "say \"hi\"", "two\nlines"}),
            "\"x,y\",\"say \"\"hi\"\"\",\"two\nlines\"\n");
}

TEST(YamlTest, BlockStyleWithQuotedStrings) {
  const json j = json::parse(R"({"a": 1, "s": "x: y", "n": null, "b": true,
                                 "list": [1, {"k": "v", "e": []}], "o": {}, "weird key": 2.5})");
  EXPECT_EQ(ToYaml(j),
            "a: 1\n"
            "b: true\n"
            "list:\n"
            "- 1\n"
            "- e: []\n"
            "  k: \"v\"\n"
            "n: null\n"
            "o: {}\n"
            "s: \"x: y\"\n"
            "\"weird key\": 2.5\n");
  EXPECT_EQ(ToYaml(json::object()), "{}\n");
}

}  // namespace
}  // namespace ulysses::ctl
