// ulyssesctl: asks one ulyssesd about its state, drains it (DESIGN.md section 7).
//
// Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: any
// other status; drain --wait: not idle in time), 2 the daemon could not be reached, 64 bad
// usage.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "ulysses/proto/grpc_status.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulyssesctl/format.h"
#include "ulyssesctl/metrics.h"
#include "ulyssesctl/target.h"

namespace ulysses::ctl {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUnreachable = 2;
constexpr int kExitUsage = 64;

struct Options {
  std::string socket;
  bool json = false;
  std::int64_t timeout_ms = 5000;
};

template <typename Request, typename Response>
using Method = grpc::Status (v1::Admin::Stub::*)(grpc::ClientContext*, const Request&, Response*);

class Ctl {
 public:
  explicit Ctl(const Options& options)
      : options_(options),
        address_(ResolveSocket(ChooseSocket(options.socket, std::getenv("ULYSSES_SOCKET")))),
        channel_(grpc::CreateChannel(address_.target, grpc::InsecureChannelCredentials())) {}

  // Calls Admin.`rpc` with `request`; prints the answer as JSON or text.
  template <typename Request, typename Response>
  int Admin(const char* rpc, Method<Request, Response> method, const Request& request,
            nlohmann::json (*to_json)(const Response&),
            const std::function<std::string(const Response&)>& render) {
    Response response;
    const grpc::Status status = Call(method, request, &response);
    if (!status.ok()) return Fail(rpc, status);
    if (options_.json) {
      PrintJson(to_json(response));
    } else {
      std::cout << render(response);
    }
    return kExitOk;
  }

  // Admin with an empty request.
  template <typename Request, typename Response>
  int Admin(const char* rpc, Method<Request, Response> method,
            nlohmann::json (*to_json)(const Response&),
            const std::function<std::string(const Response&)>& render) {
    return Admin(rpc, method, Request(), to_json, render);
  }

  // Drain; with `wait`, then GetState every 100 ms until the daemon is idle, for at most
  // `wait_timeout_ms`.
  int Drain(bool wait, std::int64_t wait_timeout_ms) {
    v1::DrainResponse drained;
    grpc::Status status = Call(&v1::Admin::Stub::Drain, v1::DrainRequest(), &drained);
    if (!status.ok()) return Fail("Drain", status);
    if (!wait || drained.idle()) return PrintDrain(drained);
    if (!options_.json) std::cout << RenderDrain(drained) << std::flush;

    using Clock = std::chrono::steady_clock;
    constexpr auto kPollInterval = std::chrono::milliseconds(100);
    const auto deadline = Clock::now() + std::chrono::milliseconds(wait_timeout_ms);
    v1::DrainResponse last = drained;
    while (true) {
      const auto now = Clock::now();
      if (now >= deadline) {
        std::cerr << "ulyssesctl: drain: not idle after " << wait_timeout_ms
                  << " ms: " << RenderDrain(last);
        return kExitFailed;
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(kPollInterval, deadline - now));
      v1::DaemonState state;
      status = Call(&v1::Admin::Stub::GetState, v1::GetStateRequest(), &state);
      if (!status.ok()) return Fail("GetState", status);
      last = DrainFromState(state);
      if (!state.draining()) {
        std::cerr << "ulyssesctl: drain: the daemon stopped draining (undrained?) before it "
                     "was idle\n";
        return kExitFailed;
      }
      if (state.idle()) return PrintDrain(last);
    }
  }

  int Metrics() {
    v1::GetMetricsResponse response;
    const grpc::Status status =
        Call(&v1::Admin::Stub::GetMetrics, v1::GetMetricsRequest(), &response);
    if (!status.ok()) return Fail("GetMetrics", status);
    if (!options_.json) {
      std::cout << response.text();
      if (!response.text().empty() && response.text().back() != '\n') std::cout << '\n';
      return kExitOk;
    }
    std::vector<MetricSample> samples;
    std::string error;
    if (!ParseMetricsText(response.text(), &samples, &error)) {
      std::cerr << "ulyssesctl: GetMetrics: cannot parse the daemon's metrics: " << error << '\n';
      return kExitFailed;
    }
    PrintJson(MetricsToJson(samples));
    return kExitOk;
  }

  int Health() {
    auto stub = grpc::health::v1::Health::NewStub(channel_);
    grpc::ClientContext context;
    SetDeadline(context);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("");
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    if (!status.ok()) return Fail("Health.Check", status);
    const std::string name =
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    if (options_.json) {
      PrintJson(HealthToJson(name));
    } else {
      std::cout << name << '\n';
    }
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk
                                                                                 : kExitFailed;
  }

 private:
  template <typename Request, typename Response>
  grpc::Status Call(Method<Request, Response> method, const Request& request,
                    Response* response) {
    auto stub = v1::Admin::NewStub(channel_);
    grpc::ClientContext context;
    SetDeadline(context);
    return ((*stub).*method)(&context, request, response);
  }

  int PrintDrain(const v1::DrainResponse& response) {
    if (options_.json) {
      PrintJson(DrainToJson(response));
    } else {
      std::cout << RenderDrain(response);
    }
    return kExitOk;
  }

  void SetDeadline(grpc::ClientContext& context) const {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(options_.timeout_ms));
  }

  static void PrintJson(const nlohmann::json& document) {
    std::cout << document.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }

  int Fail(const char* rpc, const grpc::Status& status) {
    if (IsUnreachable(status.error_code(), channel_->GetState(false))) {
      std::cerr << "ulyssesctl: cannot reach ulyssesd at " << address_.display << ": "
                << UnreachableReason(address_, status, options_.timeout_ms) << '\n';
      return kExitUnreachable;
    }
    std::cerr << "ulyssesctl: " << rpc << ": " << FromGrpcStatus(status).ToString() << '\n';
    return kExitFailed;
  }

  Options options_;
  DaemonAddress address_;
  std::shared_ptr<grpc::Channel> channel_;
};

std::int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int Main(int argc, char** argv) {
  CLI::App app("Ask a ulyssesd daemon about its state.", "ulyssesctl");
  app.set_version_flag("--version", ULYSSES_VERSION);
  // Global options may also follow the command: `ulyssesctl clients --json`.
  app.fallthrough();
  app.require_subcommand(1, 1);
  app.footer(
      "Commands: status, clients, groups, sessions, slots, recent [--limit N], drain [--wait "
      "[--wait-timeout-ms N]], undrain, metrics, health.\n"
      "Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: "
      "any other status; drain --wait: not idle in time), 2 the daemon could not be reached, "
      "64 bad usage.");
  Options options;
  app.add_option("--socket", options.socket,
                 "Daemon socket: a path or a unix: target (default: $ULYSSES_SOCKET, else " +
                     std::string(kDefaultSocket) + ")");
  app.add_flag("--json", options.json, "Print one JSON document instead of a table");
  app.add_option("--timeout-ms", options.timeout_ms, "Deadline of the call in milliseconds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  std::function<int(Ctl&)> command;
  auto add = [&](const char* name, const char* help, std::function<int(Ctl&)> run) {
    CLI::App* sub = app.add_subcommand(name, help);
    sub->callback([&command, run] { command = run; });
    return sub;
  };
  add("status",
      "Daemon state: version, device, backend, MPS mode, health, draining, idle, counts, "
      "metrics address",
      [](Ctl& c) {
        return c.Admin<v1::GetStateRequest, v1::DaemonState>(
            "GetState", &v1::Admin::Stub::GetState, &StateToJson, &RenderState);
      });
  add("clients", "Attached clients", [](Ctl& c) {
    return c.Admin<v1::ListClientsRequest, v1::ListClientsResponse>(
        "ListClients", &v1::Admin::Stub::ListClients, &ClientsToJson,
        [](const v1::ListClientsResponse& r) { return RenderClients(r, NowUnixMs()); });
  });
  add("groups", "Groups this daemon's clients joined", [](Ctl& c) {
    return c.Admin<v1::ListGroupsRequest, v1::ListGroupsResponse>(
        "ListGroups", &v1::Admin::Stub::ListGroups, &GroupsToJson, &RenderGroups);
  });
  add("sessions", "Head-exchange sessions", [](Ctl& c) {
    return c.Admin<v1::ListSessionsRequest, v1::ListSessionsResponse>(
        "ListSessions", &v1::Admin::Stub::ListSessions, &SessionsToJson, &RenderSessions);
  });
  add("slots", "Receive slots of every session", [](Ctl& c) {
    return c.Admin<v1::ListSlotsRequest, v1::ListSlotsResponse>(
        "ListSlots", &v1::Admin::Stub::ListSlots, &SlotsToJson, &RenderSlots);
  });
  std::int32_t recent_limit = 0;
  add("recent", "The flight recorder: the daemon's most recent calls, newest first",
      [&recent_limit](Ctl& c) {
        v1::ListRecentCallsRequest request;
        request.set_limit(recent_limit);
        return c.Admin<v1::ListRecentCallsRequest, v1::ListRecentCallsResponse>(
            "ListRecentCalls", &v1::Admin::Stub::ListRecentCalls, request, &RecentCallsToJson,
            &RenderRecentCalls);
      })
      ->add_option("--limit", recent_limit, "At most this many calls (0: all the recorder holds)")
      ->check(CLI::Range(0, std::numeric_limits<std::int32_t>::max()))
      ->capture_default_str();
  bool drain_wait = false;
  std::int64_t drain_wait_timeout_ms = 60000;
  CLI::App* drain = add(
      "drain",
      "Stop taking new clients and sessions (health NOT_SERVING); running sessions keep working",
      [&drain_wait, &drain_wait_timeout_ms](Ctl& c) {
        return c.Drain(drain_wait, drain_wait_timeout_ms);
      });
  CLI::Option* wait_flag = drain->add_flag(
      "--wait", drain_wait, "Then wait until no call is running (polls every 100 ms)");
  drain
      ->add_option("--wait-timeout-ms", drain_wait_timeout_ms,
                   "Give up waiting after this long (exit 1)")
      ->check(CLI::PositiveNumber)
      ->needs(wait_flag)
      ->capture_default_str();
  add("undrain", "Take new clients and sessions again (health SERVING)", [](Ctl& c) {
    return c.Admin<v1::UndrainRequest, v1::UndrainResponse>(
        "Undrain", &v1::Admin::Stub::Undrain, &UndrainToJson, &RenderUndrain);
  });
  add("metrics", "The daemon's metrics (Prometheus text; --json: parsed samples)",
      [](Ctl& c) { return c.Metrics(); });
  add("health", "grpc.health.v1 check: prints SERVING or NOT_SERVING; exit 0 only when SERVING",
      [](Ctl& c) { return c.Health(); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  Ctl ctl(options);
  return command(ctl);
}

}  // namespace
}  // namespace ulysses::ctl

int main(int argc, char** argv) { return ulysses::ctl::Main(argc, argv); }
