// Runs the built ulyssesctl binary against missing sockets and against an in-process fake
// daemon (Admin + the standard health service) on a temporary unix socket.
#include <fcntl.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ctl_test_util.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulyssesctl/format.h"

extern char** environ;

namespace ulysses::ctl {
namespace {

using nlohmann::json;

struct Result {
  int exit_code = -1;  // negative: killed by that signal
  std::string out;
  std::string err;
};

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs ulyssesctl with `args`; $ULYSSES_SOCKET is removed from the environment unless
// `socket_env` is non-empty, in which case it is set to it. Output goes through files, so a
// chatty child can never block on a full pipe.
Result RunCtl(const std::filesystem::path& dir, const std::vector<std::string>& args,
              const std::string& socket_env = "") {
  const std::filesystem::path out_path = dir / "stdout";
  const std::filesystem::path err_path = dir / "stderr";
  std::vector<std::string> argv_s = {ULYSSESCTL_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "ULYSSES_SOCKET=", 15) != 0) env_s.emplace_back(*e);
  }
  if (!socket_env.empty()) env_s.push_back("ULYSSES_SOCKET=" + socket_env);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  Result r;
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << argv[0] << ": " << std::strerror(rc);
    return r;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  return r;
}

class FakeAdmin final : public v1::Admin::Service {
 public:
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* out) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !hang_; });
    *out = testing::SampleState();
    return grpc::Status::OK;
  }
  grpc::Status ListClients(grpc::ServerContext*, const v1::ListClientsRequest*,
                           v1::ListClientsResponse* out) override {
    *out = testing::SampleClients();
    return grpc::Status::OK;
  }
  grpc::Status ListGroups(grpc::ServerContext*, const v1::ListGroupsRequest*,
                          v1::ListGroupsResponse* out) override {
    *out = testing::SampleGroups();
    return grpc::Status::OK;
  }
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse* out) override {
    *out = testing::SampleSessions();
    return grpc::Status::OK;
  }
  grpc::Status ListSlots(grpc::ServerContext*, const v1::ListSlotsRequest*,
                         v1::ListSlotsResponse* out) override {
    if (fail_slots_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon is draining");
    *out = testing::SampleSlots();
    return grpc::Status::OK;
  }

  void set_fail_slots(bool v) { fail_slots_ = v; }
  // While hanging, GetState blocks until Release().
  void Hang() {
    std::lock_guard<std::mutex> lock(mu_);
    hang_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hang_ = false;
    }
    cv_.notify_all();
  }

 private:
  std::atomic<bool> fail_slots_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool hang_ = false;
};

// Serves FakeAdmin (and, when `with_health`, grpc's default health service) on `socket`;
// listening once the constructor returns.
class FakeDaemon {
 public:
  FakeDaemon(const std::string& socket, bool with_health) {
    grpc::EnableDefaultHealthCheckService(with_health);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(&admin_);
    server_ = builder.BuildAndStart();
  }
  ~FakeDaemon() {
    admin_.Release();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  bool ok() const { return server_ != nullptr; }
  FakeAdmin& admin() { return admin_; }
  void SetServing(bool serving) { server_->GetHealthCheckService()->SetServingStatus(serving); }

 private:
  FakeAdmin admin_;
  std::unique_ptr<grpc::Server> server_;
};

class UlyssesctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ulyssesctl_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr) << std::strerror(errno);
    dir_ = tmpl;
    socket_ = (dir_ / "d.sock").string();
  }
  void TearDown() override {
    daemon_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  void StartDaemon(bool with_health = true) {
    daemon_ = std::make_unique<FakeDaemon>(socket_, with_health);
    ASSERT_TRUE(daemon_->ok()) << "fake daemon did not start on " << socket_;
  }
  Result Run(std::vector<std::string> args) {
    args.insert(args.begin(), {"--socket", socket_});
    return RunCtl(dir_, args);
  }
  json RunJson(const std::string& command) {
    const Result r = Run({"--json", command});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    return json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  }

  std::filesystem::path dir_;
  std::string socket_;
  std::unique_ptr<FakeDaemon> daemon_;
};

TEST_F(UlyssesctlTest, MissingSocketExitsTwoWithCannotReach) {
  const std::string missing = (dir_ / "missing.sock").string();
  const Result r = RunCtl(dir_, {"--socket", missing, "status"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "ulyssesctl: cannot reach ulyssesd at " + missing +
                       ": No such file or directory\n");
}

TEST_F(UlyssesctlTest, EveryCommandExitsTwoWithoutADaemon) {
  for (const char* command : {"status", "clients", "groups", "sessions", "slots", "health"}) {
    for (const bool as_json : {false, true}) {
      std::vector<std::string> args = {"--socket", socket_, command};
      if (as_json) args.push_back("--json");
      const Result r = RunCtl(dir_, args);
      EXPECT_EQ(r.exit_code, 2) << command << " " << r.err;
      EXPECT_EQ(r.out, "") << command;
      EXPECT_EQ(r.err.rfind("ulyssesctl: cannot reach ulyssesd at " + socket_ + ": ", 0), 0u)
          << r.err;
    }
  }
}

TEST_F(UlyssesctlTest, RefusedConnectionExitsTwo) {
  // A bound socket nobody listens on refuses connections.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  const Result r = Run({"health"});
  ::close(fd);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "ulyssesctl: cannot reach ulyssesd at " + socket_ + ": Connection refused\n");
}

TEST_F(UlyssesctlTest, DefaultSocketComesFromTheEnvironment) {
  StartDaemon();
  const Result r = RunCtl(dir_, {"status"}, socket_);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RenderState(testing::SampleState()));
}

TEST_F(UlyssesctlTest, AcceptsUnixTargetsAndOptionsAfterTheCommand) {
  StartDaemon();
  const Result r = RunCtl(dir_, {"status", "--socket", "unix:" + socket_, "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out, nullptr, false), StateToJson(testing::SampleState()));
}

TEST_F(UlyssesctlTest, Status) {
  StartDaemon();
  const Result r = Run({"status"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RenderState(testing::SampleState()));
  const json j = RunJson("status");
  ASSERT_TRUE(j.is_object()) << j;
  EXPECT_EQ(j, StateToJson(testing::SampleState()));
  EXPECT_EQ(j["device"], 3);
  EXPECT_EQ(j["draining"], true);
  EXPECT_EQ(j["calls_total"].get<std::uint64_t>(), 9'000'000'000ULL);
  EXPECT_EQ(j["socket"], "/run/ulysses/gpu3.sock");
}

TEST_F(UlyssesctlTest, Clients) {
  StartDaemon();
  const Result r = Run({"clients"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // Ages (and so the AGE column's width) depend on the clock; the header words do not.
  std::istringstream header(r.out.substr(0, r.out.find('\n')));
  const std::vector<std::string> words{std::istream_iterator<std::string>(header),
                                       std::istream_iterator<std::string>()};
  const std::vector<std::string> want = {"ID",      "NAME",   "PID",      "UID",  "AGE",
                                         "BUFFERS", "MEMORY", "SESSIONS", "CALLS"};
  EXPECT_EQ(words, want);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3);
  EXPECT_NE(r.out.find("trainer-rank0"), std::string::npos);
  EXPECT_NE(r.out.find("12.5 MiB"), std::string::npos);
  const json j = RunJson("clients");
  EXPECT_EQ(j, ClientsToJson(testing::SampleClients()));
  ASSERT_EQ(j["clients"].size(), 2u);
  EXPECT_EQ(j["clients"][0]["name"], "trainer-rank0");
  EXPECT_EQ(j["clients"][0]["buffer_bytes"], 13107200);
  EXPECT_EQ(j["clients"][1]["calls"].get<std::uint64_t>(), 18'446'744'073'709'551'615ULL);
}

TEST_F(UlyssesctlTest, Groups) {
  StartDaemon();
  const Result r = Run({"groups"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RenderGroups(testing::SampleGroups()));
  const json j = RunJson("groups");
  EXPECT_EQ(j, GroupsToJson(testing::SampleGroups()));
  ASSERT_EQ(j["groups"].size(), 1u);
  EXPECT_EQ(j["groups"][0]["info"]["name"], "tp0");
  EXPECT_EQ(j["groups"][0]["info"]["members"].size(), 2u);
  EXPECT_EQ(j["groups"][0]["client_ids"], json::parse("[1,22]"));
}

TEST_F(UlyssesctlTest, Sessions) {
  StartDaemon();
  const Result r = Run({"sessions"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RenderSessions(testing::SampleSessions()));
  const json j = RunJson("sessions");
  EXPECT_EQ(j, SessionsToJson(testing::SampleSessions()));
  ASSERT_EQ(j["sessions"].size(), 1u);
  EXPECT_EQ(j["sessions"][0]["info"]["spec"]["dtype"], "DTYPE_BFLOAT16");
  EXPECT_EQ(j["sessions"][0]["info"]["slot_bytes"], 33554432);
  EXPECT_EQ(j["sessions"][0]["last_epoch"], 41);
}

TEST_F(UlyssesctlTest, Slots) {
  StartDaemon();
  const Result r = Run({"slots"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, RenderSlots(testing::SampleSlots()));
  const json j = RunJson("slots");
  EXPECT_EQ(j, SlotsToJson(testing::SampleSlots()));
  ASSERT_EQ(j["slots"].size(), 2u);
  EXPECT_EQ(j["slots"][0]["state"], "ready");
  EXPECT_EQ(j["slots"][1]["age_ms"], 250);
}

TEST_F(UlyssesctlTest, HealthServing) {
  StartDaemon();
  const Result r = Run({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  EXPECT_EQ(RunJson("health"), json::parse(R"({"status":"SERVING"})"));
}

TEST_F(UlyssesctlTest, HealthNotServingExitsOne) {
  StartDaemon();
  daemon_->SetServing(false);
  Result r = Run({"health"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.out, "NOT_SERVING\n");
  r = Run({"--json", "health"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(json::parse(r.out, nullptr, false), json::parse(R"({"status":"NOT_SERVING"})"));
}

TEST_F(UlyssesctlTest, HealthWithoutHealthServiceIsAnError) {
  StartDaemon(/*with_health=*/false);
  const Result r = Run({"health"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("ulyssesctl: Health.Check: UNIMPLEMENTED", 0), 0u) << r.err;
}

TEST_F(UlyssesctlTest, DaemonErrorPrintsCodeAndMessageAndExitsOne) {
  StartDaemon();
  daemon_->admin().set_fail_slots(true);
  const Result r = Run({"slots"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "ulyssesctl: ListSlots: UNAVAILABLE: daemon is draining\n");
}

TEST_F(UlyssesctlTest, DeadlineExitsTwo) {
  StartDaemon();
  daemon_->admin().Hang();  // released when the fake daemon stops
  const Result r = Run({"--timeout-ms", "300", "status"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "ulyssesctl: cannot reach ulyssesd at " + socket_ +
                       ": no answer within 300 ms\n");
}

TEST_F(UlyssesctlTest, UsageErrorsExitSixtyFour) {
  EXPECT_EQ(RunCtl(dir_, {}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"frobnicate"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"status", "clients"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"--timeout-ms", "0", "status"}).exit_code, 64);
  const Result help = RunCtl(dir_, {"--help"});
  EXPECT_EQ(help.exit_code, 0);
  for (const char* command : {"status", "clients", "groups", "sessions", "slots", "health"}) {
    EXPECT_NE(help.out.find(command), std::string::npos) << command;
  }
}

}  // namespace
}  // namespace ulysses::ctl
