// ulyssesctl: asks one ulyssesd about its state (DESIGN.md section 7).
//
// Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: any
// other status), 2 the daemon could not be reached, 64 bad usage.
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "ulysses/proto/grpc_status.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulyssesctl/format.h"
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

class Ctl {
 public:
  explicit Ctl(const Options& options)
      : options_(options),
        address_(ResolveSocket(ChooseSocket(options.socket, std::getenv("ULYSSES_SOCKET")))),
        channel_(grpc::CreateChannel(address_.target, grpc::InsecureChannelCredentials())) {}

  // Calls Admin.`rpc` with an empty request; prints the answer as JSON or text.
  template <typename Request, typename Response>
  int Admin(const char* rpc,
            grpc::Status (v1::Admin::Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
            nlohmann::json (*to_json)(const Response&),
            const std::function<std::string(const Response&)>& render) {
    auto stub = v1::Admin::NewStub(channel_);
    grpc::ClientContext context;
    SetDeadline(context);
    Response response;
    const grpc::Status status = ((*stub).*method)(&context, Request(), &response);
    if (!status.ok()) return Fail(rpc, status);
    if (options_.json) {
      PrintJson(to_json(response));
    } else {
      std::cout << render(response);
    }
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
      "Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: "
      "any other status), 2 the daemon could not be reached, 64 bad usage.");
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
    app.add_subcommand(name, help)->callback([&command, run] { command = run; });
  };
  add("status", "Daemon state: version, device, backend, health, counts", [](Ctl& c) {
    return c.Admin<v1::GetStateRequest, v1::DaemonState>("GetState", &v1::Admin::Stub::GetState,
                                                           &StateToJson, &RenderState);
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
