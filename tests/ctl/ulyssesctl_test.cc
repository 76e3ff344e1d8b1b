// Runs the built ulyssesctl binary against missing sockets and against an in-process fake
// daemon (Admin + the standard health service) on a temporary unix socket.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
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
#include "ulysses/common/sockets.h"
#include "ulysses/common/strings.h"
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
  // SampleState() until Drain is called; from then on the drain simulation's state (see
  // SimulateBusy).
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* out) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !hang_; });
    ++get_state_calls_;
    *out = testing::SampleState();
    if (drain_calls_ > 0) {
      ++polls_;
      if (polls_until_idle_ >= 0 && polls_ >= polls_until_idle_) active_calls_ = 0;
      if (polls_until_undrained_ >= 0 && polls_ >= polls_until_undrained_) draining_ = false;
      out->set_draining(draining_);
      out->set_active_calls(active_calls_);
      out->set_idle(active_calls_ == 0);
    }
    return grpc::Status::OK;
  }
  // SampleClients() a page at a time: the token is the index of the page's first client (with
  // repeat_token, always the same token: a listing that never ends).
  grpc::Status ListClients(grpc::ServerContext*, const v1::ListClientsRequest* req,
                           v1::ListClientsResponse* out) override {
    const v1::ListClientsResponse all = testing::SampleClients();
    const int from = req->page_token().empty() ? 0 : std::stoi(req->page_token());
    const int size = req->page_size() > 0 ? req->page_size() : all.clients_size();
    for (int i = from; i < std::min(from + size, all.clients_size()); ++i)
      *out->add_clients() = all.clients(i);
    std::lock_guard<std::mutex> lock(mu_);
    client_page_sizes_.push_back(req->page_size());
    if (repeat_token_) out->set_next_page_token("1");
    else if (from + size < all.clients_size())
      out->set_next_page_token(std::to_string(from + size));
    return grpc::Status::OK;
  }
  std::vector<int> client_page_sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    return client_page_sizes_;
  }
  void set_repeat_token(bool v) {
    std::lock_guard<std::mutex> lock(mu_);
    repeat_token_ = v;
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

  grpc::Status ListRecentCalls(grpc::ServerContext*, const v1::ListRecentCallsRequest* request,
                               v1::ListRecentCallsResponse* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    last_limit_ = request->limit();
    *out = testing::SampleRecentCalls();
    if (request->limit() > 0 && out->calls_size() > request->limit()) {
      out->mutable_calls()->DeleteSubrange(request->limit(), out->calls_size() - request->limit());
    }
    return grpc::Status::OK;
  }
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*,
                     v1::DrainResponse* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++drain_calls_;
    draining_ = true;
    out->set_draining(true);
    out->set_idle(active_calls_ == 0);
    out->set_active_calls(active_calls_);
    out->set_num_sessions(testing::SampleState().num_sessions());
    return grpc::Status::OK;
  }
  grpc::Status Undrain(grpc::ServerContext*, const v1::UndrainRequest*,
                       v1::UndrainResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++undrain_calls_;
    draining_ = false;
    return grpc::Status::OK;
  }
  grpc::Status GetMetrics(grpc::ServerContext*, const v1::GetMetricsRequest*,
                          v1::GetMetricsResponse* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    out->set_text(metrics_text_);
    return grpc::Status::OK;
  }

  void set_fail_slots(bool v) { fail_slots_ = v; }
  // Drain simulation: Drain answers with `active_calls` running; GetState, from its
  // `polls_until_idle`-th answer after Drain on, reports none running (idle); negative: never.
  // From its `polls_until_undrained`-th answer on it reports the daemon not draining.
  void SimulateBusy(int active_calls, int polls_until_idle, int polls_until_undrained = -1) {
    std::lock_guard<std::mutex> lock(mu_);
    active_calls_ = active_calls;
    polls_until_idle_ = polls_until_idle;
    polls_until_undrained_ = polls_until_undrained;
    polls_ = 0;
  }
  void set_metrics_text(std::string text) {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_text_ = std::move(text);
  }
  int get_state_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return get_state_calls_;
  }
  int drain_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return drain_calls_;
  }
  int undrain_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return undrain_calls_;
  }
  bool draining() {
    std::lock_guard<std::mutex> lock(mu_);
    return draining_;
  }
  int last_limit() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_limit_;
  }
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
  int get_state_calls_ = 0;
  int drain_calls_ = 0;
  int undrain_calls_ = 0;
  bool draining_ = false;
  int active_calls_ = 0;
  int polls_ = 0;
  int polls_until_idle_ = 0;
  int polls_until_undrained_ = -1;
  int last_limit_ = -1;
  std::vector<int> client_page_sizes_;
  bool repeat_token_ = false;
  std::string metrics_text_ = testing::SampleMetricsText();
};

// Serves FakeAdmin (and, when `with_health`, grpc's default health service) on `socket` and
// on its operator socket; listening once the constructor returns.
class FakeDaemon {
 public:
  FakeDaemon(const std::string& socket, bool with_health) {
    grpc::EnableDefaultHealthCheckService(with_health);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.AddListeningPort("unix:" + socket + std::string(ulysses::kOperatorSocketSuffix),
                             grpc::InsecureServerCredentials());
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
  json RunJson(const std::string& command, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {"--json", command};
    args.insert(args.end(), more.begin(), more.end());
    const Result r = Run(args);
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
  for (const char* command : {"status", "clients", "groups", "sessions", "slots", "recent",
                              "drain", "undrain", "metrics", "health"}) {
    for (const bool as_json : {false, true}) {
      std::vector<std::string> args = {"--socket", socket_, command};
      if (as_json) args.push_back("--json");
      const Result r = RunCtl(dir_, args);
      EXPECT_EQ(r.exit_code, 2) << command << " " << r.err;
      EXPECT_EQ(r.out, "") << command;
      // drain and undrain go to the operator socket, and name it.
      const bool operator_call = std::string(command).find("drain") != std::string::npos;
      const std::string at =
          operator_call ? socket_ + std::string(ulysses::kOperatorSocketSuffix) : socket_;
      EXPECT_EQ(r.err.rfind("ulyssesctl: cannot reach ulyssesd at " + at + ": ", 0), 0u)
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
  EXPECT_EQ(j["mps_mode"], "no-mps");
  EXPECT_EQ(j["active_calls"], 2);
  EXPECT_EQ(j["idle"], false);
  EXPECT_EQ(j["metrics_address"], "127.0.0.1:9464");
  for (const char* line : {"\nmps mode:      no-mps\n", "\nidle:          no\n",
                           "\nactive calls:  2\n", "\nmetrics:       127.0.0.1:9464\n"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " not in\n" << r.out;
  }
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

TEST_F(UlyssesctlTest, ListingsAreReadPageAfterPage) {
  StartDaemon();
  const json j = RunJson("clients", {"--page-size", "1"});
  EXPECT_EQ(j, ClientsToJson(testing::SampleClients()));
  EXPECT_EQ(daemon_->admin().client_page_sizes(), (std::vector<int>{1, 1}));
  const Result table = Run({"clients", "--page-size", "1"});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_EQ(std::count(table.out.begin(), table.out.end(), '\n'), 3);
  // Without --page-size the daemon picks (0 asks for its default).
  EXPECT_EQ(RunJson("clients"), ClientsToJson(testing::SampleClients()));
  EXPECT_EQ(daemon_->admin().client_page_sizes().back(), 0);
  for (const char* bad : {"-1", "1001", "x"}) {
    const Result r = Run({"clients", "--page-size", bad});
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.err.find("--page-size"), std::string::npos) << bad << ": " << r.err;
  }
}

TEST_F(UlyssesctlTest, AListingThatNeverEndsIsAFailure) {
  StartDaemon();
  daemon_->admin().set_repeat_token(true);
  const Result r = Run({"clients", "--page-size", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("did not end"), std::string::npos) << r.err;
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
  EXPECT_EQ(j["sessions"][0]["info"]["spec"]["dtype"], "bfloat16");
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
  EXPECT_DOUBLE_EQ(j["slots"][1]["age_seconds"].get<double>(), 0.25);
}

TEST_F(UlyssesctlTest, Recent) {
  StartDaemon();
  const Result r = Run({"recent"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // The child inherits $TZ, so in-process rendering shows the same local times.
  EXPECT_EQ(r.out, RenderRecentCalls(testing::SampleRecentCalls()));
  std::istringstream header(r.out.substr(0, r.out.find('\n')));
  const std::vector<std::string> words{std::istream_iterator<std::string>(header),
                                       std::istream_iterator<std::string>()};
  const std::vector<std::string> want = {"CLIENT", "SESSION",  "EPOCH",  "OP",     "B",
                                         "SEQ",    "QUEUED",   "DURATION", "STATUS", "MESSAGE"};
  EXPECT_EQ(words, want);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 4);
  EXPECT_NE(r.out.find("850us"), std::string::npos);
  EXPECT_NE(r.out.find("peer rank 0 did not answer"), std::string::npos);
  EXPECT_EQ(daemon_->admin().last_limit(), 0);

  const json j = RunJson("recent");
  EXPECT_EQ(j, RecentCallsToJson(testing::SampleRecentCalls()));
  EXPECT_EQ(j["capacity"], 256);
  ASSERT_EQ(j["calls"].size(), 3u);
  EXPECT_EQ(j["calls"][0]["op"], "scatter_heads");
  EXPECT_EQ(j["calls"][0]["queued_time"], "2023-11-14T22:13:20.123456Z");
  EXPECT_EQ(j["calls"][0]["done_time"], "2023-11-14T22:13:20.124306Z");
  EXPECT_EQ(j["calls"][1]["seq"].get<std::int64_t>(), 9'000'000'000LL);
  EXPECT_EQ(j["calls"][1]["sent_bytes"].get<std::uint64_t>(), 5'000'000'000ULL);
  EXPECT_EQ(j["calls"][2]["status"], "DEADLINE_EXCEEDED");
  EXPECT_EQ(j["calls"][2]["message"], "peer rank 0 did not answer");
}

TEST_F(UlyssesctlTest, RecentLimit) {
  StartDaemon();
  const json j = RunJson("recent", {"--limit", "1"});
  EXPECT_EQ(daemon_->admin().last_limit(), 1);
  ASSERT_EQ(j["calls"].size(), 1u);
  EXPECT_EQ(j["calls"][0]["epoch"], 41);
  EXPECT_EQ(j["capacity"], 256);
  const Result r = Run({"recent", "--limit", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(daemon_->admin().last_limit(), 2);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3);
}

TEST_F(UlyssesctlTest, DrainIdle) {
  StartDaemon();
  Result r = Run({"drain"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "draining; idle\n");
  EXPECT_TRUE(daemon_->admin().draining());
  const json j = RunJson("drain");
  EXPECT_EQ(j, json::parse(R"({"draining":true,"idle":true,"active_calls":0,"num_sessions":1})"));
  // Already idle: --wait has nothing to wait for.
  r = Run({"drain", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "draining; idle\n");
  EXPECT_EQ(daemon_->admin().drain_calls(), 3);
  EXPECT_EQ(daemon_->admin().get_state_calls(), 0);
}

TEST_F(UlyssesctlTest, DrainBusyWithoutWait) {
  StartDaemon();
  daemon_->admin().SimulateBusy(2, -1);
  const Result r = Run({"drain"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "draining; 2 call(s) running, 1 session(s) open\n");
  const json j = RunJson("drain");
  EXPECT_EQ(j["draining"], true);
  EXPECT_EQ(j["idle"], false);
  EXPECT_EQ(j["active_calls"], 2);
  EXPECT_EQ(j["num_sessions"], 1);
  EXPECT_EQ(daemon_->admin().get_state_calls(), 0);
}

TEST_F(UlyssesctlTest, DrainWaitSucceedsOnceIdle) {
  StartDaemon();
  daemon_->admin().SimulateBusy(2, /*polls_until_idle=*/2);
  Result r = Run({"drain", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(r.out,
            "draining; 2 call(s) running, 1 session(s) open\n"
            "draining; idle\n");
  EXPECT_EQ(daemon_->admin().get_state_calls(), 2);

  daemon_->admin().SimulateBusy(3, /*polls_until_idle=*/2);
  r = Run({"--json", "drain", "--wait", "--wait-timeout-ms", "60000"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out, nullptr, false),
            json::parse(R"({"draining":true,"idle":true,"active_calls":0,"num_sessions":1})"));
  EXPECT_EQ(daemon_->admin().get_state_calls(), 4);
}

TEST_F(UlyssesctlTest, DrainWaitTimesOutExitsOne) {
  StartDaemon();
  daemon_->admin().SimulateBusy(2, /*polls_until_idle=*/-1);
  Result r = Run({"drain", "--wait", "--wait-timeout-ms", "250"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "draining; 2 call(s) running, 1 session(s) open\n");
  EXPECT_EQ(r.err,
            "ulyssesctl: drain: not idle after 250 ms: draining; 2 call(s) running, 1 "
            "session(s) open\n");
  EXPECT_GE(daemon_->admin().get_state_calls(), 1);
  r = Run({"drain", "--json", "--wait", "--wait-timeout-ms", "150"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("ulyssesctl: drain: not idle after 150 ms: ", 0), 0u) << r.err;
}

TEST_F(UlyssesctlTest, DrainWaitGivesUpWhenUndrained) {
  StartDaemon();
  daemon_->admin().SimulateBusy(2, /*polls_until_idle=*/-1, /*polls_until_undrained=*/1);
  const Result r = Run({"drain", "--wait"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("ulyssesctl: drain: the daemon stopped draining", 0), 0u) << r.err;
  EXPECT_EQ(daemon_->admin().get_state_calls(), 1);
}

TEST_F(UlyssesctlTest, Undrain) {
  StartDaemon();
  ASSERT_EQ(Run({"drain"}).exit_code, 0);
  ASSERT_TRUE(daemon_->admin().draining());
  const Result r = Run({"undrain"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "serving; idle\n");
  EXPECT_FALSE(daemon_->admin().draining());
  // The same fields as drain --json prints.
  EXPECT_EQ(RunJson("undrain"),
            json::parse(R"({"draining":false,"idle":true,"active_calls":0,"num_sessions":1})"));
  EXPECT_EQ(daemon_->admin().undrain_calls(), 2);
}

TEST_F(UlyssesctlTest, Metrics) {
  StartDaemon();
  const Result r = Run({"metrics"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, testing::SampleMetricsText());

  const json j = RunJson("metrics");
  ASSERT_TRUE(j.contains("metrics")) << j;
  const json& m = j["metrics"];
  ASSERT_EQ(m.size(), 10u) << m;  // comment and blank lines skipped
  EXPECT_EQ(m[0], json::parse(R"({"name":"ulysses_calls_total",
                                   "labels":{"op":"scatter_heads","status":"OK"},"value":40})"));
  EXPECT_EQ(m[4]["name"], "ulysses_call_seconds_bucket");
  EXPECT_EQ(m[4]["labels"], json::parse(R"({"op":"scatter_heads","le":"+Inf"})"));
  EXPECT_EQ(m[4]["value"], 40);
  EXPECT_DOUBLE_EQ(m[5]["value"].get<double>(), 0.123);
  EXPECT_EQ(m[7]["labels"], json::object());
  EXPECT_EQ(m[8]["timestamp_ms"].get<std::int64_t>(), 1'700'000'000'123LL);
  EXPECT_EQ(m[9]["labels"]["name"], "say \"hi\"");
  for (const auto& sample : m) {
    EXPECT_EQ(sample["name"].get<std::string>().find('#'), std::string::npos);
  }
}

TEST_F(UlyssesctlTest, MalformedMetricsFailOnlyAsJson) {
  StartDaemon();
  daemon_->admin().set_metrics_text("ok 1\nbroken{a=\"x\" 2\n");
  Result r = Run({"metrics"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "ok 1\nbroken{a=\"x\" 2\n");
  r = Run({"--json", "metrics"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("ulyssesctl: GetMetrics: cannot parse the daemon's metrics: line 2: ", 0),
            0u)
      << r.err;
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
  EXPECT_EQ(RunCtl(dir_, {"recent", "--limit", "-1"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"recent", "--limit", "x"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"drain", "--wait-timeout-ms", "100"}).exit_code, 64);  // needs --wait
  EXPECT_EQ(RunCtl(dir_, {"drain", "--wait", "--wait-timeout-ms", "0"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"status", "--limit", "1"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"-o", "xml", "status"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"-o", "json", "--json", "status"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"--watch", "0", "status"}).exit_code, 64);
  EXPECT_EQ(RunCtl(dir_, {"--watch", "1", "drain"}).exit_code, 64);
  // One line naming what is wrong, never CLI11's 300-digit ranges or "A subcommand is required".
  const std::vector<std::pair<std::vector<std::string>, std::string>> messages = {
      {{"bogus"}, "ulyssesctl: unknown command 'bogus' (commands: status, clients,"},
      {{}, "ulyssesctl: a command is required (status, clients,"},
      {{"--timeout-ms", "0", "status"}, "ulyssesctl: --timeout-ms: must be an integer >= 1, got '0'"},
      {{"status", "--bogus"}, "ulyssesctl: unknown option '--bogus' for status"},
      {{"-o", "xml", "status"}, "ulyssesctl: --output: 'xml' is not table, wide, json, yaml or csv"},
  };
  for (const auto& [args, want] : messages) {
    const Result r = RunCtl(dir_, args);
    EXPECT_EQ(r.exit_code, 64) << want;
    EXPECT_EQ(r.err.rfind(want, 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  const Result help = RunCtl(dir_, {"--help"});
  EXPECT_EQ(help.exit_code, 0);
  for (const char* command : {"status", "clients", "groups", "sessions", "slots", "recent",
                              "drain", "undrain", "metrics", "health"}) {
    EXPECT_NE(help.out.find(StrCat("\n  ", command, " ")), std::string::npos) << command;
  }
  EXPECT_NE(help.out.find("Commands: status, clients, groups, sessions, slots, recent [--limit N], "
                          "drain [--wait [--wait-timeout-ms N]], undrain, metrics, health."),
            std::string::npos)
      << help.out;
  EXPECT_NE(help.out.find("--timeout-ms INT=5000"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("-o,--output TEXT=table"), std::string::npos) << help.out;
}

TEST_F(UlyssesctlTest, OutputFormats) {
  StartDaemon();
  // yaml: the same document as json.
  Result r = Run({"-o", "yaml", "slots"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ToYaml(SlotsToJson(testing::SampleSlots())));
  EXPECT_NE(r.out.find("\n- age_seconds: 3.2\n  epoch: 41\n"), std::string::npos) << r.out;
  EXPECT_EQ(json::parse(Run({"-o", "json", "slots"}).out, nullptr, false),
            SlotsToJson(testing::SampleSlots()));
  // csv: raw numbers under unit names; --no-headers drops the header line.
  r = Run({"slots", "-o", "csv"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, SlotsListing(testing::SampleSlots()).Render(OutputFormat::kCsv, true));
  EXPECT_EQ(r.out.rfind("session_id,slot,state,owner_client_id,epoch,age_seconds\n", 0), 0u);
  r = Run({"-o", "csv", "--no-headers", "slots"});
  EXPECT_EQ(r.out, "5,0,ready,1,41,3.2\n5,1,free,0,40,0.25\n");
  r = Run({"--no-headers", "slots"});
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  EXPECT_EQ(r.out.find("SESSION"), std::string::npos) << r.out;
  // wide: more columns than table.
  r = Run({"-o", "wide", "sessions"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("SCHEDULE"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("7,9"), std::string::npos) << r.out;
  // status as one CSV row; health and drain in every format.
  r = Run({"-o", "csv", "status"});
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  EXPECT_NE(r.out.find("0000:18:00.0"), std::string::npos) << r.out;
  EXPECT_EQ(Run({"-o", "csv", "health"}).out, "status\nSERVING\n");
  EXPECT_EQ(Run({"-o", "yaml", "health"}).out, "status: \"SERVING\"\n");
  EXPECT_EQ(Run({"-o", "csv", "--no-headers", "drain"}).out, "true,true,0,1\n");
  // metrics: parsed samples as CSV.
  r = Run({"-o", "csv", "metrics"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("ulysses_calls_total,\"op=scatter_heads,status=OK\",40,\n"),
            std::string::npos)
      << r.out;
}

// Runs ulyssesctl with its stdout on a pipe; returns the pid and the pipe's read end.
std::pair<pid_t, int> SpawnWithPipe(const std::vector<std::string>& args) {
  int fds[2];
  if (::pipe(fds) != 0) return {-1, -1};
  std::vector<std::string> argv_s = {ULYSSESCTL_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return {-1, -1};
  }
  return {pid, fds[0]};
}

TEST_F(UlyssesctlTest, WatchPrintsEveryRoundUntilInterrupted) {
  StartDaemon();
  auto [pid, fd] = SpawnWithPipe({"--socket", socket_, "--watch", "0.05", "-o", "json", "status"});
  ASSERT_GT(pid, 0);
  // json under --watch: one compact document per line. Read three rounds (each bounded).
  std::string got;
  while (std::count(got.begin(), got.end(), '\n') < 3) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 30000), 1) << "no round within 30 s; so far: " << got;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    ASSERT_GT(n, 0) << "ulyssesctl --watch ended early: " << got;
    got.append(buf, static_cast<std::size_t>(n));
  }
  ::kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ::close(fd);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::istringstream lines(got);
  std::string line;
  for (int i = 0; i < 3 && std::getline(lines, line); ++i)
    EXPECT_EQ(json::parse(line, nullptr, false), StateToJson(testing::SampleState())) << line;
  EXPECT_GE(daemon_->admin().get_state_calls(), 3);
}

}  // namespace
}  // namespace ulysses::ctl
