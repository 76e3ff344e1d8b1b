// The daemon's JSON config: values, key checking, types and file loading.
#include "ulysses/common/config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <algorithm>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

constexpr const char* kFullConfig = R"json({
  "log_level": "debug",
  "backend": "host",
  "timeouts": {"call_ms": 1500, "peer_ms": 2500},
  "slots": {"memory_budget_bytes": 1073741824, "uid_share_percent": 40},
  "metrics": {"address": "127.0.0.1:9400"},
  "ready_file": "/tmp/ulysses-ready",
  "devices": [
    {"index": 0, "socket": "/tmp/ulysses/gpu0.sock"},
    {"index": 1, "socket": "/tmp/ulysses/gpu1.sock"},
    {"index": 2}
  ]
})json";

TEST(DaemonConfigTest, FullConfigParsed) {
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(kFullConfig, 1);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->device, 1);
  EXPECT_EQ(c->socket, "/tmp/ulysses/gpu1.sock");
  EXPECT_EQ(c->backend, "host");
  EXPECT_EQ(c->log_level, "debug");
  EXPECT_EQ(c->call_timeout_ms, 1500);
  EXPECT_EQ(c->peer_timeout_ms, 2500);
  EXPECT_EQ(c->slot_memory_budget_bytes, 1073741824u);
  EXPECT_EQ(c->slot_uid_share_percent, 40);
  EXPECT_EQ(c->metrics_address, "127.0.0.1:9400");
  EXPECT_EQ(c->ready_file, "/tmp/ulysses-ready");
  ASSERT_EQ(c->devices.size(), 3u);
  EXPECT_EQ(c->devices[0].index, 0);
  EXPECT_EQ(c->devices[0].socket, "/tmp/ulysses/gpu0.sock");
  EXPECT_EQ(c->devices[1].index, 1);
  EXPECT_EQ(c->devices[1].socket, "/tmp/ulysses/gpu1.sock");
  EXPECT_EQ(c->devices[2].index, 2);
  EXPECT_EQ(c->devices[2].socket, "/run/ulysses/gpu2.sock");  // default for a device without one
}

TEST(DaemonConfigTest, PicksTheRequestedDevicesSocket) {
  absl::StatusOr<DaemonConfig> c0 = ParseDaemonConfig(kFullConfig, 0);
  ASSERT_THAT(c0, IsOk());
  EXPECT_EQ(c0->socket, "/tmp/ulysses/gpu0.sock");
  absl::StatusOr<DaemonConfig> c2 = ParseDaemonConfig(kFullConfig, 2);
  ASSERT_THAT(c2, IsOk());
  EXPECT_EQ(c2->socket, "/run/ulysses/gpu2.sock");
  absl::StatusOr<DaemonConfig> c7 = ParseDaemonConfig(kFullConfig, 7);  // not listed
  ASSERT_THAT(c7, IsOk());
  EXPECT_EQ(c7->socket, "/run/ulysses/gpu7.sock");
}

TEST(DaemonConfigTest, EmptyObjectGivesDefaults) {
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig("{}", 3);
  ASSERT_THAT(c, IsOk());
  const DaemonConfig d;
  EXPECT_EQ(c->device, 3);
  EXPECT_EQ(c->socket, DefaultSocketPath(3));
  EXPECT_EQ(c->backend, d.backend);
  EXPECT_EQ(c->backend, "auto");
  EXPECT_EQ(c->log_level, "info");
  EXPECT_EQ(c->call_timeout_ms, d.call_timeout_ms);
  EXPECT_EQ(c->peer_timeout_ms, d.peer_timeout_ms);
  EXPECT_EQ(c->slot_memory_budget_bytes, d.slot_memory_budget_bytes);
  EXPECT_TRUE(c->metrics_address.empty());
  EXPECT_TRUE(c->ready_file.empty());
  EXPECT_TRUE(c->devices.empty());
}

TEST(DaemonConfigTest, DefaultSocketPath) {
  EXPECT_EQ(DefaultSocketPath(0), "/run/ulysses/gpu0.sock");
  EXPECT_EQ(DefaultSocketPath(12), "/run/ulysses/gpu12.sock");
}

TEST(DaemonConfigTest, UnknownTopLevelKeyNamed) {
  EXPECT_THAT(ParseDaemonConfig(R"({"backend": "host", "bogus": 1})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("bogus"), HasSubstr("unknown key"))));
  // A key that only exists nested is unknown at the top.
  EXPECT_THAT(ParseDaemonConfig(R"({"call_ms": 10})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("call_ms"), HasSubstr("unknown key"))));
}

TEST(DaemonConfigTest, UnknownNestedKeyNamedWithFullPath) {
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"call_msx": 10}})", 0),
              StatusIs(kInvalid, HasSubstr("timeouts.call_msx")));
  EXPECT_THAT(ParseDaemonConfig(R"({"slots": {"count": 2}})", 0),
              StatusIs(kInvalid, HasSubstr("slots.count")));
  EXPECT_THAT(ParseDaemonConfig(R"({"metrics": {"port": 9400}})", 0),
              StatusIs(kInvalid, HasSubstr("metrics.port")));
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"index": 0}, {"index": 1, "sock": "/x"}]})", 0),
              StatusIs(kInvalid, HasSubstr("devices[1].sock")));
}

TEST(DaemonConfigTest, WrongTypesNamed) {
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"call_ms": "10"}})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("timeouts.call_ms"), HasSubstr("integer"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"peer_ms": 1.5}})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("timeouts.peer_ms"), HasSubstr("integer"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"backend": 3})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("backend"), HasSubstr("string"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"ready_file": true})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("ready_file"), HasSubstr("string"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"metrics": {"address": 9400}})", 0),
              StatusIs(kInvalid, HasSubstr("metrics.address")));
  EXPECT_THAT(ParseDaemonConfig(R"({"slots": {"memory_budget_bytes": -1}})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("slots.memory_budget_bytes"),
                                       HasSubstr("negative"))));
  for (const char* share : {"0", "101", "-5"})
    EXPECT_THAT(ParseDaemonConfig(StrCat(R"({"slots": {"uid_share_percent": )", share, "}}"), 0),
                StatusIs(kInvalid, HasSubstr("slots.uid_share_percent")))
        << share;
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": 5})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("timeouts"), HasSubstr("object"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": {"index": 0}})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("devices"), HasSubstr("array"))));
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"index": "0"}]})", 0),
              StatusIs(kInvalid, HasSubstr("devices[0].index")));
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"socket": "/x"}]})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("devices[0].index"), HasSubstr("required"))));
  EXPECT_THAT(ParseDaemonConfig(R"([1, 2])", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("config"), HasSubstr("object"))));
}

TEST(DaemonConfigTest, InvalidJsonRejected) {
  for (const char* text : {"{", "", "{\"backend\": }", "{'backend': 'host'}"}) {
    EXPECT_THAT(ParseDaemonConfig(text, 0),
                StatusIs(kInvalid, AllOf(HasSubstr("config"), HasSubstr("JSON"))))
        << text;
  }
}

// A number beyond a double's range is an out_of_range exception of the JSON library, not a
// parse error: it escaped ParseDaemonConfig and terminated `ulyssesd --config` (found by
// fuzz/config_fuzz.cc).
TEST(DaemonConfigTest, NumberBeyondADoubleIsInvalidJsonNotACrash) {
  for (const char* text : {R"({"timeouts": {"call_ms": 104E577}})", R"({"x": -1e400})",
                           R"([1e309])"}) {
    EXPECT_THAT(ParseDaemonConfig(text, 0),
                StatusIs(kInvalid, AllOf(HasSubstr("config"), HasSubstr("JSON"))))
        << text;
  }
}

TEST(DaemonConfigTest, BadBackendNamed) {
  EXPECT_THAT(ParseDaemonConfig(R"({"backend": "gloo"})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("backend"), HasSubstr("gloo"))));
  for (std::string_view backend : kRunnableBackends) {
    EXPECT_THAT(ParseDaemonConfig(StrCat(R"({"backend": ")", backend, "\"}"), 0), IsOk())
        << backend;
  }
}

TEST(DaemonConfigTest, MessagesNameTheFlagOfAKey) {
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"call_ms": 0}})", 0),
              StatusIs(kInvalid, HasSubstr("timeouts.call_ms (--call-timeout-ms): must be > 0, "
                                           "got 0")));
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"drain_ms": -1}})", 0),
              StatusIs(kInvalid, HasSubstr("timeouts.drain_ms (--drain-timeout-ms): must be >= 0")));
  EXPECT_THAT(ParseDaemonConfig(R"({"flight_recorder_size": 0})", 0),
              StatusIs(kInvalid, HasSubstr("flight_recorder_size: must be in [1, 1000000]")));
  EXPECT_EQ(FlagOfKey("metrics.address"), "--metrics-address");
  EXPECT_EQ(FlagOfKey("slots.memory_budget_bytes"), "");
}

TEST(DaemonConfigTest, EveryDeviceEntryIsChecked) {
  // Entries of other devices too: a node config is shared by every daemon of the node.
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"index": 0}, {"index": 1, "socket": ""}]})", 0),
              StatusIs(kInvalid, HasSubstr("devices[1].socket: path must be 1..100")));
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"index": -1}]})", 0),
              StatusIs(kInvalid, HasSubstr("devices[0].index: must be >= 0, got -1")));
}

TEST(HostPortTest, ParsesNamesIpv4AndBracketedIpv6) {
  absl::StatusOr<HostPort> hp = ParseHostPort("127.0.0.1:9500");
  ASSERT_THAT(hp, IsOk());
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 9500);
  EXPECT_EQ(hp->ToString(), "127.0.0.1:9500");
  hp = ParseHostPort("[::1]:0");
  ASSERT_THAT(hp, IsOk());
  EXPECT_EQ(hp->host, "::1");
  EXPECT_EQ(hp->port, 0);
  EXPECT_EQ(hp->WithPort(37443), "[::1]:37443");
  hp = ParseHostPort("node-1.example:65535");
  ASSERT_THAT(hp, IsOk());
  EXPECT_EQ(hp->port, 65535);
}

TEST(HostPortTest, RefusesWhatCannotBeBoundAsWritten) {
  EXPECT_THAT(ParseHostPort("::1:0"), StatusIs(kInvalid, HasSubstr("needs brackets")));
  EXPECT_THAT(ParseHostPort("localhost"), StatusIs(kInvalid, HasSubstr("no port")));
  EXPECT_THAT(ParseHostPort(":9500"), StatusIs(kInvalid, HasSubstr("empty host")));
  for (const char* bad : {"h:99999", "h:65536", "h:-1", "h:", "h:0080", "h:12a", "h:+5",
                          "h:123456"})
    EXPECT_THAT(ParseHostPort(bad), StatusIs(kInvalid, HasSubstr("not a number in 0..65535")))
        << bad;
  for (const char* bad : {"[]:1", "[::1:1", "[zz::1]:1", "[1.2.3.4]:1", "a b:1"})
    EXPECT_THAT(ParseHostPort(bad), StatusIs(kInvalid, HasSubstr(bad))) << bad;
  EXPECT_THAT(ParseDaemonConfig(R"({"metrics": {"address": "127.0.0.1:99999"}})", 0),
              StatusIs(kInvalid, HasSubstr("metrics.address (--metrics-address): "
                                           "'127.0.0.1:99999': port '99999' is not a number")));
}

TEST(DaemonConfigTest, DuplicateDeviceIndexNamed) {
  EXPECT_THAT(ParseDaemonConfig(
                  R"({"devices": [{"index": 1, "socket": "/a"}, {"index": 1, "socket": "/b"}]})",
                  1),
              StatusIs(kInvalid, HasSubstr("devices[1].index: 1 is listed twice")));
}

TEST(DaemonConfigTest, ValuesChecked) {
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"call_ms": 0}})", 0),
              StatusIs(kInvalid, HasSubstr("timeouts.call_ms")));
  EXPECT_THAT(ParseDaemonConfig(R"({"timeouts": {"peer_ms": -5}})", 0),
              StatusIs(kInvalid, HasSubstr("timeouts.peer_ms")));
  EXPECT_THAT(ParseDaemonConfig(R"({"log_level": "loud"})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("log_level"), HasSubstr("loud"))));
  const std::string long_socket = "/" + std::string(120, 's');
  EXPECT_THAT(ParseDaemonConfig(R"({"devices": [{"index": 0, "socket": ")" + long_socket +
                                    "\"}]}",
                                0),
              StatusIs(kInvalid, HasSubstr("socket")));
  EXPECT_THAT(ParseDaemonConfig("{}", -1), StatusIs(kInvalid, HasSubstr("device")));
}

TEST(DaemonConfigTest, ValidateDaemonConfigDirectly) {
  DaemonConfig c;
  c.socket = "/tmp/s.sock";
  EXPECT_THAT(ValidateDaemonConfig(c), IsOk());
  c.backend = "mpi";
  EXPECT_THAT(ValidateDaemonConfig(c), StatusIs(kInvalid, HasSubstr("backend")));
  c.backend = "host";
  c.socket.clear();
  EXPECT_THAT(ValidateDaemonConfig(c), StatusIs(kInvalid, HasSubstr("socket")));
  c.socket = "/tmp/s.sock";
  c.devices = {{0, "/a"}, {2, "/b"}, {0, "/c"}};
  EXPECT_THAT(ValidateDaemonConfig(c),
              StatusIs(kInvalid, HasSubstr("devices[2].index: 0 is listed twice")));
}

// A file under the test's temp dir, removed at the end of the test.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    path_ = ::testing::TempDir() + "ulysses_config_test_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter_++) + ".json";
    std::ofstream out(path_);
    out << contents;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

TEST(LoadDaemonConfigTest, MissingFileIsNotFound) {
  const std::string path = ::testing::TempDir() + "ulysses_config_test_does_not_exist.json";
  EXPECT_THAT(LoadDaemonConfig(path, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
}

TEST(LoadDaemonConfigTest, ReadsAFile) {
  TempFile f(kFullConfig);
  absl::StatusOr<DaemonConfig> c = LoadDaemonConfig(f.path(), 0);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->socket, "/tmp/ulysses/gpu0.sock");
  EXPECT_EQ(c->backend, "host");
  EXPECT_EQ(c->call_timeout_ms, 1500);
}

TEST(LoadDaemonConfigTest, ErrorsKeepCodeAndNameTheFileAndKey) {
  TempFile f(R"({"timeouts": {"call_msx": 10}})");
  EXPECT_THAT(LoadDaemonConfig(f.path(), 0),
              StatusIs(kInvalid, AllOf(HasSubstr(f.path()), HasSubstr("timeouts.call_msx"))));
}

}  // namespace
}  // namespace ulysses

namespace ulysses {
namespace {

TEST(DaemonConfigRangeTest, IntegersOutOfTheirFieldsRangeAreRefused) {
  // A device index beyond int32 must not wrap around to another device.
  EXPECT_EQ(ParseDaemonConfig(R"({"devices": [{"index": 4294967297, "socket": "/a"}]})", 1)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status s =
      ParseDaemonConfig(R"({"slots": {"memory_budget_bytes": 18446744073709551615}})", 0).status();
  EXPECT_TRUE(s.ok()) << s;  // the largest uint64 is a valid (unbounded) budget
  s = ParseDaemonConfig(R"({"timeouts": {"call_ms": 9223372036854775808}})", 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("timeouts.call_ms: out of range"), std::string::npos) << s;
  s = ParseDaemonConfig(R"({"slots": {"memory_budget_bytes": -1}})", 0).status();
  EXPECT_NE(std::string(s.message()).find("must not be negative"), std::string::npos) << s;
}

}  // namespace
}  // namespace ulysses

namespace ulysses {
namespace {

TEST(DaemonConfigTest, BindTimeoutParsedAndBounded) {
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(R"({"timeouts": {"bind_ms": 250}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bind_timeout_ms, 250);
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->bind_timeout_ms, 10000);
  for (const char* bad : {R"({"timeouts": {"bind_ms": 0}})", R"({"timeouts": {"bind_ms": 3600001}})"}) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(bad, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("timeouts.bind_ms"), std::string::npos) << r.status();
  }
}

TEST(DaemonConfigTest, WorkerStallThresholdParsedAndBounded) {
  absl::StatusOr<DaemonConfig> c =
      ParseDaemonConfig(R"({"timeouts": {"worker_stall_ms": 0}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->worker_stall_ms, 0);
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->worker_stall_ms, 10000);
  for (const char* bad : {R"({"timeouts": {"worker_stall_ms": -1}})",
                          R"({"timeouts": {"worker_stall_ms": 3600001}})",
                          R"({"timeouts": {"worker_stall_ms": "soon"}})"}) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(bad, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("timeouts.worker_stall_ms"), std::string::npos)
        << r.status();
  }
}

}  // namespace
}  // namespace ulysses

namespace ulysses {
namespace {

TEST(DaemonConfigTest, LimitsParsedDefaultedAndChecked) {
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(
      R"({"limits": {"max_clients": 5, "clients_per_uid": 2, "buffers_per_client": 7,
                     "buffers_per_uid": 9, "buffer_bytes_per_client": 4096, "buffer_bytes_per_uid": 8192,
                     "pending_fds_per_client": 3, "calls_in_progress_per_client": 4,
                     "calls_in_progress_per_uid": 5, "admin_calls_in_progress": 6}})",
      0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->limits.max_clients, 5);
  EXPECT_EQ(c->limits.clients_per_uid, 2);
  EXPECT_EQ(c->limits.buffers_per_client, 7);
  EXPECT_EQ(c->limits.buffers_per_uid, 9);
  EXPECT_EQ(c->limits.buffer_bytes_per_client, 4096u);
  EXPECT_EQ(c->limits.buffer_bytes_per_uid, 8192u);
  EXPECT_EQ(c->limits.pending_fds_per_client, 3);
  EXPECT_EQ(c->limits.calls_in_progress_per_client, 4);
  EXPECT_EQ(c->limits.calls_in_progress_per_uid, 5);
  EXPECT_EQ(c->limits.admin_calls_in_progress, 6);
  const DaemonLimits defaults;
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->limits.max_clients, defaults.max_clients);
  for (const char* bad : {R"({"limits": {"max_clients": 0}})",
                          R"({"limits": {"buffer_bytes_per_uid": 0}})",
                          R"({"limits": {"buffers_per_uid": 0}})",
                          R"({"limits": {"pending_fds_per_client": -1}})",
                          R"({"limits": {"calls_in_progress_per_client": 0}})",
                          R"({"limits": {"admin_calls_in_progress": 0}})",
                          R"({"limits": {"calls_in_progress_per_uid": -2}})",
                          R"({"limits": {"clients": 1}})", R"({"limits": []})"}) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(bad, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("limits"), std::string::npos) << r.status();
  }
}

// Every limit of the table is read from its key, and 0 is refused naming it.
TEST(DaemonConfigTest, EveryLimitIsReadAndZeroIsRefusedNamingIt) {
  for (const LimitField& f : kLimitFields) {
    const std::string key(f.key);
    absl::StatusOr<DaemonConfig> c =
        ParseDaemonConfig("{\"limits\": {\"" + key + "\": 7}}", 0);
    ASSERT_TRUE(c.ok()) << key << ": " << c.status();
    EXPECT_EQ(f.value(c->limits), 7u) << key;
    EXPECT_NE(f.value(DaemonLimits{}), 7u) << key << ": the default is not what was read";
    absl::StatusOr<DaemonConfig> zero =
        ParseDaemonConfig("{\"limits\": {\"" + key + "\": 0}}", 0);
    EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_NE(zero.status().message().find("limits." + key), std::string::npos) << zero.status();
  }
  // Each key has a field of its own.
  for (size_t i = 0; i < kLimitFields.size(); ++i)
    for (size_t j = i + 1; j < kLimitFields.size(); ++j) {
      const LimitField &x = kLimitFields[i], &y = kLimitFields[j];
      EXPECT_NE(x.key, y.key);
      EXPECT_FALSE(x.count != nullptr && x.count == y.count) << x.key << " and " << y.key;
      EXPECT_FALSE(x.bytes != nullptr && x.bytes == y.bytes) << x.key << " and " << y.key;
    }
  // And it is the field its name says.
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(
      R"({"limits": {"max_sessions": 11, "sessions_per_uid": 12, "sessions_per_client": 13,
                     "groups_per_client": 14, "max_buffers": 15, "max_pending_fds": 16,
                     "pending_fds_per_uid": 17, "connections_per_uid": 18,
                     "max_connections": 19}})",
      0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->limits.max_sessions, 11);
  EXPECT_EQ(c->limits.sessions_per_uid, 12);
  EXPECT_EQ(c->limits.sessions_per_client, 13);
  EXPECT_EQ(c->limits.groups_per_client, 14);
  EXPECT_EQ(c->limits.max_buffers, 15);
  EXPECT_EQ(c->limits.max_pending_fds, 16);
  EXPECT_EQ(c->limits.pending_fds_per_uid, 17);
  EXPECT_EQ(c->limits.connections_per_uid, 18);
  EXPECT_EQ(c->limits.max_connections, 19);
}

}  // namespace
TEST(DaemonConfig, QueueProbeAndSharingAreReadCheckedAndNamedWithTheirFlags) {
  absl::StatusOr<DaemonConfig> d = ParseDaemonConfig("{}", 0);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->queue_probe_streams, 16);
  EXPECT_EQ(d->queue_sharing, "allow");
  absl::StatusOr<DaemonConfig> c =
      ParseDaemonConfig(R"({"queues": {"probe_streams": 0, "sharing": "refuse"}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->queue_probe_streams, 0);
  EXPECT_EQ(c->queue_sharing, "refuse");
  const std::pair<const char*, const char*> bad[] = {
      {R"({"queues": {"probe_streams": 65}})", "queues.probe_streams (--queue-probe-streams)"},
      {R"({"queues": {"probe_streams": -1}})", "queues.probe_streams (--queue-probe-streams)"},
      {R"({"queues": {"sharing": "never"}})", "queues.sharing (--queue-sharing)"},
      {R"({"queues": {"sharing": 1}})", "queues.sharing"},
      {R"({"queues": {"probe": 4}})", "queues.probe"}};
  for (const auto& [text, named] : bad) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(text, 0);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(named), std::string::npos) << r.status();
  }
}

TEST(DaemonConfig, FusedProjectionIsReadCheckedAndNamedWithItsFlag) {
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->fused_projection, "cublaslt");
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(R"({"fused": {"projection": "cutlass"}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fused_projection, "cutlass");
  const std::pair<const char*, const char*> bad[] = {
      {R"({"fused": {"projection": "cublas"}})", "fused.projection (--fused-projection)"},
      {R"({"fused": {"projection": 1}})", "fused.projection"},
      {R"({"fused": {"path": "auto"}})", "fused.path"}};
  for (const auto& [text, named] : bad) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(text, 0);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(named), std::string::npos) << r.status();
  }
}

TEST(DaemonConfig, RingWorkerSpinIsReadBoundedAndNamedWithItsFlag) {
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->ring_spin_us, 50);
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(R"({"rings": {"worker_spin_us": 2000}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ring_spin_us, 2000);
  EXPECT_EQ(ParseDaemonConfig(R"({"rings": {"worker_spin_us": 0}})", 0)->ring_spin_us, 0);
  for (const char* bad : {R"({"rings": {"worker_spin_us": -1}})",
                          R"({"rings": {"worker_spin_us": 1000001}})"}) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(bad, 0);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("rings.worker_spin_us (--ring-spin-us)"),
              std::string::npos)
        << r.status();
  }
  absl::StatusOr<DaemonConfig> typo = ParseDaemonConfig(R"({"rings": {"spin_us": 5}})", 0);
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("spin_us"), std::string::npos) << typo.status();
}

TEST(DaemonConfig, TheOperatorGroupIsAKnownGroupOrAGidNamedWithItsFlag) {
  EXPECT_EQ(ParseDaemonConfig("{}", 0)->operator_group, "");
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(R"({"admin": {"operator_group": "0"}})", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->operator_group, "0");
  EXPECT_EQ(*ResolveGroup("0"), 0u);
  EXPECT_EQ(*ResolveGroup("root"), 0u);  // every system names gid 0
  EXPECT_TRUE(ParseDaemonConfig(R"({"admin": {"operator_group": "root"}})", 0).ok());
  for (const auto& [bad, rule] :
       {std::pair<const char*, const char*>{R"({"admin": {"operator_group": "no-such-group-x"}})",
                                            "no group named 'no-such-group-x'"},
        {R"({"admin": {"operator_group": "99999999999"}})", "out of range"},
        {R"({"admin": {"operator_group": ""}})", nullptr}}) {
    absl::StatusOr<DaemonConfig> r = ParseDaemonConfig(bad, 0);
    if (rule == nullptr) {  // empty: no operators' group
      ASSERT_TRUE(r.ok()) << r.status();
      continue;
    }
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("admin.operator_group (--operator-group)"),
              std::string::npos)
        << r.status();
    EXPECT_NE(r.status().message().find(rule), std::string::npos) << r.status();
  }
  absl::StatusOr<DaemonConfig> typo = ParseDaemonConfig(R"({"admin": {"group": "0"}})", 0);
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("admin.group: unknown key"), std::string::npos)
      << typo.status();
}

}  // namespace ulysses
