// The daemon's JSON config: values, key checking, types and file loading.
#include "ulysses/common/config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

constexpr const char* kFullConfig = R"json({
  "log_level": "debug",
  "backend": "host",
  "timeouts": {"call_ms": 1500, "peer_ms": 2500},
  "slots": {"memory_budget_bytes": 1073741824},
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

TEST(DaemonConfigTest, BadBackendNamed) {
  EXPECT_THAT(ParseDaemonConfig(R"({"backend": "gloo"})", 0),
              StatusIs(kInvalid, AllOf(HasSubstr("backend"), HasSubstr("gloo"))));
  for (const char* backend : {"auto", "host", "nccl", "nvlink"}) {
    EXPECT_THAT(ParseDaemonConfig(std::string(R"({"backend": ")") + backend + "\"}", 0), IsOk())
        << backend;
  }
}

TEST(DaemonConfigTest, DuplicateDeviceIndexNamed) {
  EXPECT_THAT(ParseDaemonConfig(
                  R"({"devices": [{"index": 1, "socket": "/a"}, {"index": 1, "socket": "/b"}]})",
                  1),
              StatusIs(kInvalid, AllOf(HasSubstr("devices"), HasSubstr("index 1"))));
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
  c.backend = "nccl";
  c.socket.clear();
  EXPECT_THAT(ValidateDaemonConfig(c), StatusIs(kInvalid, HasSubstr("socket")));
  c.socket = "/tmp/s.sock";
  c.devices = {{0, "/a"}, {2, "/b"}, {0, "/c"}};
  EXPECT_THAT(ValidateDaemonConfig(c),
              StatusIs(kInvalid, AllOf(HasSubstr("devices"), HasSubstr("index 0"))));
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
